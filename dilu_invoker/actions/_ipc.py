"""Framing shared by the runtime proxy and its worker process (stdlib only: this ships into images).

Frames travel over a Unix socket pair: a fixed header (kind, request id, payload length) and the payload.
Payloads are raw bytes; for results they are the JSON body the proxy returns verbatim, so the proxy never
re-serializes a user's result.

The same frames carry the *direct lane* of the process backend: a socket pair whose one end the invoker
keeps and whose other end the proxy hands to the worker it initialised, so that a warm `/run` goes from the
invoker to the worker and back without waking the proxy (docs/runtime.md, "The direct lane").
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
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
    # worker -> proxy
    INIT_OK = 10  # payload: JSON list of the top-level installed modules the action imported (may be empty)
    INIT_DECODE_ERROR = 11  # code could not be decoded (bad base64): 400 like upstream
    INIT_COMPILE_ERROR = 12  # no usable source (syntax error, bad zip, no __main__.py): 502
    INIT_START_ERROR = 13  # the module could not be loaded or has no such main: 502
    RESULT = 20  # payload: JSON object or array, returned as the /run body
    RESULT_NOT_DICT = 21  # main returned something other than a dict or list
    RESULT_NOT_JSON = 22  # payload: UTF-8 message saying why the result could not be encoded
    BAD_REQUEST = 23  # payload: UTF-8 message; the run body was not usable
    PRELOADED = 30  # unsolicited (request id 0), once: JSON {modules, missing, cuda, ms} of the pre-load
    HELD_MODELS = 32  # unsolicited (request id 0), just before INIT_OK when /init left this process holding models
    # (the models API): JSON list of their names, what the invoker's model pre-loading keeps
    RUN_IMPORTS = 31  # unsolicited (request id 0), at most once, just before the first run's result: JSON list of
    # the top-level installed modules that run imported first (those `main` imports lazily)
    DIRECT_BEGIN = 33  # a run that came on the direct lane begins (its lane request id): the proxy counts it, to
    # end its logs if the worker dies meanwhile
    DIRECT_END = 34  # ... and has been answered on the lane


MSG_NOT_DICT = "The action did not return a dictionary or array."
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


def read_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly `n` bytes from a blocking socket, unbuffered (so a selector over several sockets stays true);
    None at EOF."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[int, int, bytes] | None:
    """(kind, request id, payload) of the next frame; None at EOF."""
    header = read_exact(sock, HEADER.size)
    if header is None:
        return None
    kind, request_id, length = HEADER.unpack(header)
    payload = read_exact(sock, length) if length else b""
    if payload is None:
        return None
    return kind, request_id, payload


def pack(kind: Kind, request_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, request_id, len(payload)) + payload


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
