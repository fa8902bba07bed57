"""Framing shared by the runtime proxy and its worker process (stdlib only: this ships into images).

Frames travel over a Unix socket pair: a fixed header (kind, request id, payload length) and the payload.
Payloads are raw bytes; for results they are the JSON body the proxy returns verbatim, so the proxy never
re-serializes a user's result.
"""

from __future__ import annotations

import contextlib
import enum
import os
import site
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
