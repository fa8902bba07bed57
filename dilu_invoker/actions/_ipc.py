"""Framing shared by the runtime proxy and its worker process (stdlib only: this ships into images).

Frames travel over a Unix socket pair: a fixed header (kind, request id, payload length) and the payload.
Payloads are raw bytes; for results they are the JSON body the proxy returns verbatim, so the proxy never
re-serializes a user's result.

The same frames carry the *direct lane* of the process backend: a socket pair whose one end the invoker
keeps and whose other end the proxy hands to the worker it initialised, so that a warm `/run` goes from the
invoker to the worker and back without waking the proxy (docs/runtime.md, "The direct lane").
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import enum
import json
import os
import signal
import site
import socket
import struct
import sysconfig

SENTINEL = "XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX"
SENTINEL_LINE = (SENTINEL + "\n").encode()
#: how the sentinel reads when the action itself prints it: a line that ends with it no longer ends the
#: activation's logs (the invoker ends them only at a line ending with the sentinel)
ESCAPED_SENTINEL = SENTINEL + " [escaped]"

HEADER = struct.Struct(">BQQ")


class Kind(enum.IntEnum):
    # proxy -> worker
    INIT = 1
    RUN = 2
    RUN_STAGE = 3  # a pipeline stage's run, on the direct lane only: a stage frame (`pack_stage`) whose JSON is
    # the /run body; its blob, if any, is the previous stage's tensor (`value.dilu_stage.data`)
    # worker -> proxy
    INIT_OK = 10  # payload: JSON list of the top-level installed modules the action imported (may be empty)
    INIT_DECODE_ERROR = 11  # code could not be decoded (bad base64): 400 like upstream
    INIT_COMPILE_ERROR = 12  # no usable source (syntax error, bad zip, no __main__.py): 502
    INIT_START_ERROR = 13  # the module could not be loaded or has no such main: 502
    RESULT = 20  # payload: JSON object or array, returned as the /run body
    RESULT_NOT_DICT = 21  # main returned something other than a dict or list
    RESULT_NOT_JSON = 22  # payload: UTF-8 message saying why the result could not be encoded
    BAD_REQUEST = 23  # payload: UTF-8 message; the run body was not usable
    RESULT_STAGE = 24  # the answer to a RUN_STAGE that welcomes one: a stage frame whose JSON is the result with
    # its tensor's bytes (`dilu_stage.data`, a `Blob`) taken out as the blob
    PRELOADED = 30  # unsolicited (request id 0), once: JSON {modules, missing, cuda, ms} of the pre-load
    HELD_MODELS = 32  # unsolicited (request id 0), just before INIT_OK when /init left this process holding models
    # (the models API): JSON list of their names, what the invoker's model pre-loading keeps
    RUN_IMPORTS = 31  # unsolicited (request id 0), at most once, just before the first run's result: JSON list of
    # the top-level installed modules that run imported first (those `main` imports lazily)
    DIRECT_BEGIN = 33  # a run that came on the direct lane begins (its lane request id): the proxy counts it, to
    # end its logs if the worker dies meanwhile
    DIRECT_END = 34  # ... and has been answered on the lane


MSG_NOT_DICT = "The action did not return a dictionary or array."

#: the field of a pipeline stage's intermediate result that carries its tensor (`dilu_invoker.actions.pipeline`)
STAGE_FIELD = "dilu_stage"
#: a stage frame's head: the length of its JSON part, and its flags (`WELCOME_BLOB`)
STAGE_HEAD = struct.Struct(">QB")
#: a RUN_STAGE's flag: the invoker takes a RESULT_STAGE for an answer (every stage but the last)
WELCOME_BLOB = 1
#: a stage frame as an HTTP body (`POST /run` of a runtime that takes them, and its answer)
STAGE_CONTENT_TYPE = "application/x-dilu-stage-frame"
#: the header of a successful `/init` answer by which a runtime says it takes stage frames over HTTP
STAGE_FRAMES_HEADER = "X-Dilu-Stage-Frames"


class Blob(bytes):
    """A tensor's bytes in a pipeline stage's result (`pipeline.send`): base64 text wherever the result is JSON
    (`json_default`), the raw bytes of a stage frame on the direct lane (docs/runtime.md, "Pipeline stages")."""

    __slots__ = ()


class BlobView:
    """The invoker's hold on a stage frame's blob on its way to the next stage: a view of the frame it came in, not
    a copy (no action code sees it; an action's `dilu_stage.data` is a `Blob`)."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return self.view.nbytes

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlobView):
            other = other.view
        return isinstance(other, bytes | bytearray | memoryview) and self.view == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlobView({self.view.nbytes} bytes)"


def json_default(obj: object) -> str:
    """`json.dumps`' `default`: a `Blob` (or `BlobView`) as its base64; anything else is not JSON, as without it."""
    if isinstance(obj, Blob):
        return base64.b64encode(obj).decode("ascii")
    if isinstance(obj, BlobView):
        return base64.b64encode(obj.view).decode("ascii")
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def take_blob(obj: object) -> tuple[object, bytes | memoryview | None]:
    """`obj` without the `Blob` (or `BlobView`) at `dilu_stage.data` (a shallow copy; `obj` is left as it is), and
    its bytes; `obj` itself and None when it holds none there."""
    wire = obj.get(STAGE_FIELD) if isinstance(obj, dict) else None
    blob = wire.get("data") if isinstance(wire, dict) else None
    if not isinstance(blob, Blob | BlobView):
        return obj, None
    assert isinstance(obj, dict) and isinstance(wire, dict)
    return {**obj, STAGE_FIELD: {k: v for k, v in wire.items() if k != "data"}}, \
        blob.view if isinstance(blob, BlobView) else blob


def put_blob(obj: object, blob: bytes | memoryview, *, view: bool = False) -> None:
    """Put a stage frame's blob back where `take_blob` took it: at `dilu_stage.data` of `obj`, when `obj` has a
    `dilu_stage` object without `data` (anything else leaves `obj` alone: the blob was not the tensor's). A `Blob`
    (its copy), or with `view` a `BlobView` of it (the invoker's, passing it on)."""
    wire = obj.get(STAGE_FIELD) if isinstance(obj, dict) else None
    if isinstance(wire, dict) and "data" not in wire:
        wire["data"] = BlobView(memoryview(blob)) if view else Blob(blob)


def pack_stage(text: bytes, blob: bytes | memoryview | None, flags: int = 0) -> list[bytes]:
    """A stage frame's payload, in parts (written one after the other, not joined: the blob is not copied): its
    head, its JSON part `text`, then the blob's bytes."""
    return [STAGE_HEAD.pack(len(text), flags), text, blob if blob is not None else b""]  # type: ignore[list-item]


def unpack_stage(payload: bytes) -> tuple[bytes, memoryview, int]:
    """(JSON part, blob (a view of `payload`), flags) of a stage frame's payload; ValueError when it is not one."""
    if len(payload) < STAGE_HEAD.size:
        raise ValueError("a stage frame shorter than its head")
    n, flags = STAGE_HEAD.unpack_from(payload)
    end = STAGE_HEAD.size + n
    if end > len(payload):
        raise ValueError(f"a stage frame's JSON part of {n} bytes runs past its {len(payload)} bytes")
    view = memoryview(payload)
    return bytes(view[STAGE_HEAD.size:end]), view[end:], flags
MSG_EXITED = "command exited"


def run_answer(kind: Kind, payload: bytes) -> tuple[int, bytes]:
    """The HTTP status and body of `/run` for the worker's answer frame: what the proxy answers, and what the
    invoker makes of an answer on the direct lane."""
    if kind is Kind.RESULT:
        return 200, payload
    if kind is Kind.RESULT_NOT_DICT:
        return 502, error_body(MSG_NOT_DICT)
    return 502 if kind is Kind.RESULT_NOT_JSON else 400, error_body(payload.decode("utf-8", "replace"))


def error_body(error: str) -> bytes:
    return json.dumps({"error": error}).encode()


def read_exact(sock: socket.socket, n: int, *, whole: bool = False) -> bytes | None:
    """Exactly `n` bytes from a blocking socket, unbuffered (so a selector over several sockets stays true);
    None at EOF. `whole`: the bytearray they were read into (not copied into bytes: a stage frame's tensor)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return buf if whole else bytes(buf)  # type: ignore[return-value]  # read as bytes are


def read_frame(sock: socket.socket) -> tuple[int, int, bytes] | None:
    """(kind, request id, payload) of the next frame; None at EOF."""
    header = read_exact(sock, HEADER.size)
    if header is None:
        return None
    kind, request_id, length = HEADER.unpack(header)
    payload = read_exact(sock, length, whole=kind == Kind.RUN_STAGE) if length else b""
    if payload is None:
        return None
    return kind, request_id, payload


def pack(kind: Kind, request_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, request_id, len(payload)) + payload


#: a frame at least this long is written as its parts (its payload not copied behind its header); a shorter one
#: as one write (one segment, one read on the other side)
WHOLE_WRITE_BYTES = 65536


def frame_chunks(kind: Kind, request_id: int, payload: bytes | list[bytes]) -> list[bytes]:
    """A frame whose payload is `payload` (or its parts one after the other), as what to write in turn
    (`write_chunks`)."""
    parts = payload if isinstance(payload, list) else [payload]
    return write_chunks(HEADER.pack(kind, request_id, sum(len(p) for p in parts)), parts)


def write_chunks(head: bytes, parts: list[bytes]) -> list[bytes]:
    """`head` and then `parts`, as what to write in turn: one chunk when the parts are short (one segment, one
    read on the other side), else the head and then each part as it is (a stage frame's tensor is not copied)."""
    if sum(len(p) for p in parts) < WHOLE_WRITE_BYTES:
        return [head + b"".join(parts)]
    return [head, *parts]


def installed_roots() -> tuple[str, ...]:
    """The directories installed packages live in (site-packages of every scheme), each ending in a
    separator: what the worker reports as imported and the invoker learns for pre-loading must lie in one."""
    roots: list[str] = []
    with contextlib.suppress(Exception):
        roots += site.getsitepackages()
    with contextlib.suppress(Exception):
        roots.append(site.getusersitepackages())
    for name in ("purelib", "platlib"):
        with contextlib.suppress(Exception):
            roots.append(sysconfig.get_path(name))
    return tuple(sorted({os.path.realpath(r) + os.sep for r in roots if r}))


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux), and exit now if `parent` (its pid when it started this
    process) is gone already: the kernel's parent-death signal covers only a death after the prctl."""
    with contextlib.suppress(Exception):  # not Linux: no prctl
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)
