"""The invoker's side of OpenWhisk's action runtime protocol (`/init`, `/run`, sentinel-framed logs).

Works against any OpenWhisk runtime: ours (`dilu_invoker.actions.runtime`) or an upstream image. The
response-to-activation mapping copies OpenWhisk's `ActivationResponse.processRunResponseContent` /
`processInitResponseContent` and the container client (see reference/openwhisk.md §4 and docs/runtime.md).

Three parts:
* body builders (`ActivationContext`, `build_init_body`, `build_run_body`, `env_string`, `encode_body`);
* pure outcome mapping (`run_outcome`, `init_outcome`) and the HTTP client (`RuntimeClient`);
* the log splitter (`ActivationLogReader`), an incremental reader over the runtime's stdout and stderr.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import aiohttp
import structlog

from dilu_invoker.actions._ipc import (
    HEADER,
    MSG_EXITED,
    STAGE_CONTENT_TYPE,
    STAGE_FRAMES_HEADER,
    STAGE_HEAD,
    WELCOME_BLOB,
    Kind,
    error_body,
    frame_chunks,
    json_default,
    pack_stage,
    put_blob,
    run_answer,
    take_blob,
    unpack_stage,
    write_chunks,
)
from dilu_invoker.invoker.api import MSG_ABNORMAL_RUN
from dilu_invoker.model import ActivationStatus

log = structlog.get_logger(__name__)

SENTINEL = "XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX"
DEFAULT_MAX_RESULT_BYTES = 1024 * 1024  # OpenWhisk's default action result (payload) limit: 1 MB
INIT_RETRY_INTERVAL_S = 0.05

MSG_ABNORMAL_INIT = "The action did not initialize and exited unexpectedly."

MSG_SHUTTING_DOWN = "The action container is shutting down; the activation must be rescheduled."
MSG_LOG_FAILURE = "There was an issue while collecting your logs. Data might be missing."
MSG_LOG_DEVELOPER_ERROR = "The action did not initialize or run as expected. Log data might be missing."


# OpenWhisk's status codes live in the model; re-exported here for the runtime protocol's users.


def timed_out_message(timeout_s: float, *, init: bool) -> str:
    millis = round(timeout_s * 1000)
    return f"The action exceeded its time limits of {millis} milliseconds" + (
        " during initialization." if init else "."
    )


def invalid_run_response_message(text: str) -> str:
    return "The action did not produce a valid JSON or JSON Array response" + (f": {text}" if text else ".")


def invalid_init_response_message(text: str) -> str:
    return "The action failed during initialization" + (f": {text}" if text else ".")


def truncated_response_message(prefix: str, length: int, max_length: int) -> str:
    return (
        f"The action produced a response that exceeded the allowed length: {length} > {max_length} bytes. "
        f"The truncated response was: {prefix}"
    )


def truncated_logs_message(limit_bytes: int) -> str:
    return f"Logs were truncated because the total bytes size exceeds the limit of {limit_bytes} bytes."


# -- request bodies ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ActivationContext:
    """The per-activation fields OpenWhisk sends beside `value` (§4.3) and as `__OW_*` init env (§4.2)."""

    namespace: str
    action_name: str  # fully qualified with a leading slash: /ns[/pkg]/name
    action_version: str
    activation_id: str
    transaction_id: str  # the transid's id string only
    deadline_ms: int  # epoch milliseconds: start of the run + limits.timeout
    api_key: str | None = None  # only when the action's provide-api-key annotation allows it

    def run_fields(self) -> dict[str, str]:
        fields = {
            "namespace": self.namespace,
            "action_name": self.action_name,
            "action_version": self.action_version,
            "activation_id": self.activation_id,
            "transaction_id": self.transaction_id,
            "deadline": str(int(self.deadline_ms)),
        }
        if self.api_key is not None:
            fields["api_key"] = self.api_key
        return fields

    def init_env(self) -> dict[str, str]:
        return {f"__OW_{key.upper()}": value for key, value in self.run_fields().items()}


def env_string(value: Any) -> str:
    """Stringify an init env value as OpenWhisk does: strings as is, null as "", the rest as JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


#: the init env entry holding a function's models key (dilu_invoker/actions/models.py, docs/runtime.md "models")
MODELS_KEY_ENV = "DILU_MODELS_KEY"


def models_key(secret: bytes, namespace: str, action: str, revision: str) -> str:
    """The key every instance of one function (namespace/action@revision) gets at /init: instances holding
    it may share read-only weights; other functions' instances cannot derive it (the secret is the invoker's)."""
    return hmac.new(secret, f"{namespace}\0{action}\0{revision}".encode(), hashlib.sha256).hexdigest()


def build_init_body(
    *,
    name: str,
    code: str | None,
    binary: bool,
    main: str | None = None,
    env: Mapping[str, Any] | None = None,
    context: ActivationContext | None = None,
) -> dict[str, Any]:
    """`{"value": {name, main, code, binary, env}}`; `env` is the action's init parameters plus `__OW_*`."""
    merged = {key: env_string(value) for key, value in (env or {}).items()}
    if context is not None:
        merged.update(context.init_env())
    value: dict[str, Any] = {"name": name, "main": main or "main", "binary": bool(binary)}
    if code is not None:  # a blackbox image without code gets none
        value["code"] = code
    if merged:
        value["env"] = merged
    return {"value": value}


def build_run_body(value: Any, context: ActivationContext) -> dict[str, Any]:
    """`{"value": params, <context fields>}`; `value` is the parameters object (or array), `{}` if none."""
    body: dict[str, Any] = {"value": {} if value is None else value}
    body.update(context.run_fields())
    return body


def encode_body(body: Mapping[str, Any]) -> bytes:
    """The body as JSON; a pipeline stage's tensor bytes (`Blob`) in it as base64, as the runtime writes them."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=json_default).encode("utf-8")


# -- outcomes -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RuntimeOutcome:
    """What one `/init` or `/run` means for the activation.

    `result` is the action's result on success (a dict or list), `{"error": ...}` on any error, and None for
    a successful `/init`. `size` is the response length OpenWhisk records (None when nothing came back).
    `reschedule` is set for a 503: the container is shutting down and the activation belongs on another
    container (OpenWhisk's `ContainerHealthError`); its status is a whisk error in case it cannot be moved.
    """

    status_code: ActivationStatus
    result: Any
    size: int | None = None
    timed_out: bool = False
    reschedule: bool = False
    http_status: int | None = None
    elapsed_s: float = 0.0
    #: a successful `/init`'s: the runtime takes stage frames over HTTP (`STAGE_FRAMES_HEADER`)
    stage_frames: bool = False

    @property
    def ok(self) -> bool:
        return self.status_code is ActivationStatus.SUCCESS

    @property
    def keeps_container(self) -> bool:
        """OpenWhisk keeps a container only after a success or an application error."""
        return self.status_code in (ActivationStatus.SUCCESS, ActivationStatus.APPLICATION_ERROR)

    def response_json(self) -> dict[str, Any]:
        """The stored activation's `response` object: `{"statusCode", "result", "size"?}`."""
        response: dict[str, Any] = {"statusCode": int(self.status_code), "result": self.result}
        if self.size is not None:
            response["size"] = self.size
        return response


def _error(status: ActivationStatus, error: Any, **extra: Any) -> RuntimeOutcome:
    return RuntimeOutcome(status_code=status, result={"error": error}, **extra)


def _jvm_length(text: str) -> int:
    # OpenWhisk records String.length, i.e. UTF-16 code units.
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def _parse_json(text: str) -> Any:
    def reject_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=reject_constant)


_UNPARSED = object()


def _decoded(body: bytes) -> tuple[str, int, Any]:
    """The response text, its recorded size and its JSON value (``_UNPARSED`` when it is not JSON)."""
    text = body.decode("utf-8", "replace")
    try:
        parsed = _parse_json(text)
    except ValueError:
        parsed = _UNPARSED
    return text, _jvm_length(text), parsed


def _shared_failure(*, init: bool, http_status: int | None, body: bytes, length: int, elapsed_s: float,
                    timeout_s: float, max_result_bytes: int, truncation: ActivationStatus,
                    meta: dict[str, Any]) -> RuntimeOutcome | None:
    """The failures `/init` and `/run` map alike, in OpenWhisk's order: the time limit, no usable
    response, a response over the result limit (``truncation``: its status differs between the two)."""
    if elapsed_s >= timeout_s:
        return _error(ActivationStatus.DEVELOPER_ERROR, timed_out_message(timeout_s, init=init), timed_out=True,
                      **meta)
    if http_status is None or length == 0:
        return _error(ActivationStatus.DEVELOPER_ERROR, MSG_ABNORMAL_INIT if init else MSG_ABNORMAL_RUN, **meta)
    if length > max_result_bytes:
        prefix = body[:max_result_bytes].decode("utf-8", "replace")
        return _error(truncation, truncated_response_message(prefix, length, max_result_bytes), size=length,
                      **meta)
    return None


def run_outcome(
    *,
    http_status: int | None,
    body: bytes,
    elapsed_s: float,
    timeout_s: float,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    total_length: int | None = None,
    staged: bool = False,
) -> RuntimeOutcome:
    """Map a `/run` exchange to an activation outcome (`Container.run` + `processRunResponseContent`).

    `http_status` None means no usable response (connection refused or reset, timeout, no body).
    `body` may be a prefix of a longer response whose full length is `total_length`. `staged`: `body` is a stage
    frame's payload (a RESULT_STAGE on the direct lane): its JSON part is the result, its blob the tensor bytes
    at the result's `dilu_stage.data` (a `BlobView` of `body`, not a copy); its size limit is over the whole
    frame.
    """
    length = len(body) if total_length is None else total_length
    meta: dict[str, Any] = {"http_status": http_status, "elapsed_s": elapsed_s}
    if http_status == 503:
        return _error(ActivationStatus.WHISK_ERROR, MSG_SHUTTING_DOWN, reschedule=True, **meta)
    # (a stage frame over the limit shows the start of its JSON part, not its binary head)
    shown = body[STAGE_HEAD.size:] if staged and length > max_result_bytes else body  # (not copied when it fits)
    failure = _shared_failure(init=False, http_status=http_status, body=shown,
                              length=length, elapsed_s=elapsed_s, timeout_s=timeout_s,
                              max_result_bytes=max_result_bytes, truncation=ActivationStatus.APPLICATION_ERROR,
                              meta=meta)
    if failure is not None:
        return failure
    blob = None
    if staged:
        try:
            body, blob, _ = unpack_stage(body)
        except ValueError as exc:
            return _error(ActivationStatus.DEVELOPER_ERROR, f"The action did not produce a valid stage frame: {exc}",
                          size=length, **meta)
    text, size, parsed = _decoded(body)
    if blob is not None:
        size = length
    if isinstance(parsed, dict):
        if http_status == 200:
            if "error" in parsed:
                return _error(ActivationStatus.APPLICATION_ERROR, parsed["error"], size=size, **meta)
            if blob is not None:
                put_blob(parsed, blob, view=True)
            return RuntimeOutcome(status_code=ActivationStatus.SUCCESS, result=parsed, size=size, **meta)
        error = parsed["error"] if "error" in parsed else invalid_run_response_message(text)
        return _error(ActivationStatus.DEVELOPER_ERROR, error, size=size, **meta)
    if isinstance(parsed, list) and http_status == 200:
        return RuntimeOutcome(status_code=ActivationStatus.SUCCESS, result=parsed, size=size, **meta)
    return _error(ActivationStatus.DEVELOPER_ERROR, invalid_run_response_message(text), size=size, **meta)


def init_outcome(
    *,
    http_status: int | None,
    body: bytes,
    elapsed_s: float,
    timeout_s: float,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    total_length: int | None = None,
) -> RuntimeOutcome:
    """Map an `/init` exchange (`Container.initialize` + `processInitResponseContent`).

    A 200 is a success whatever its body and duration (OpenWhisk checks `ok` before the time).
    """
    length = len(body) if total_length is None else total_length
    meta: dict[str, Any] = {"http_status": http_status, "elapsed_s": elapsed_s}
    if http_status == 503:
        return _error(ActivationStatus.WHISK_ERROR, MSG_SHUTTING_DOWN, reschedule=True, **meta)
    if http_status == 200 and length <= max_result_bytes:
        return RuntimeOutcome(status_code=ActivationStatus.SUCCESS, result=None, size=None, **meta)
    failure = _shared_failure(init=True, http_status=http_status, body=body, length=length, elapsed_s=elapsed_s,
                              timeout_s=timeout_s, max_result_bytes=max_result_bytes,
                              truncation=ActivationStatus.DEVELOPER_ERROR, meta=meta)
    if failure is not None:
        return failure
    text, size, parsed = _decoded(body)
    if isinstance(parsed, dict) and "error" in parsed:
        return _error(ActivationStatus.DEVELOPER_ERROR, parsed["error"], size=size, **meta)
    return _error(ActivationStatus.DEVELOPER_ERROR, invalid_init_response_message(text), size=size, **meta)


# -- HTTP client --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Exchange:
    http_status: int | None
    body: bytes
    total_length: int | None
    elapsed_s: float
    #: `body` is a stage frame's payload (RESULT_STAGE)
    staged: bool = False
    #: the answer carried `STAGE_FRAMES_HEADER` (a successful /init of a runtime that takes stage frames)
    stage_frames: bool = False


# The deadline is ours (asyncio.timeout); the session's default timeouts must not cut in first.
_NO_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=None)

#: an idle keep-alive connection older than this is not reused (the runtime's server closes idle ones
#: after 75 s, aiohttp's default; a connection it is closing must not carry a /run)
_IDLE_REUSE_S = 30.0
_HEAD_LIMIT = 64 * 1024


@dataclass(slots=True)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def usable(self, now: float) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing() and now - self.idle_since < _IDLE_REUSE_S

    def close(self) -> None:
        self.writer.close()


class RunConnections:
    """Keep-alive connections to the project's own runtimes, for `/run`: the warm path's one HTTP hop.

    Each `/run` is one HTTP/1.1 request on a connection of its own (concurrent runs take one each), answered
    with a `Content-Length` body — what `dilu_invoker.actions.runtime` always sends. aiohttp's client costs
    ~0.35 ms more per exchange than this on a loopback connection (measured on the 2-core dev VM: p50 0.55 vs
    0.21 ms against the same aiohttp server), a sixth of a no-op's warm invoke. Any other runtime (upstream
    images, blackbox actions) is driven through aiohttp. An answer without a usable `Content-Length`
    (chunked, none), a body past the result limit, `Connection: close`, a timeout or an error closes the
    connection; what is mapped to the activation is the same as through aiohttp."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def acquire(self, host: str, port: int) -> _Conn:
        idle = self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        reader, writer = await asyncio.open_connection(host, port, limit=_HEAD_LIMIT)
        return _Conn(reader, writer)

    def release(self, host: str, port: int, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault((host, port), []).append(conn)

    def discard(self, host: str, port: int) -> None:
        """The runtime at host:port is gone (its container is destroyed): its idle connections close."""
        for conn in self._idle.pop((host, port), []):
            conn.close()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()


def _parse_head(head: bytes) -> tuple[int, int | None, bool, str]:
    """(status, Content-Length or None when absent or chunked, whether the connection may be reused, the media
    type of Content-Type, lower case, "" when absent)."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    status = int(rest[:3])
    length: int | None = None
    chunked = False
    reuse = version == "HTTP/1.1"
    media = ""
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            continue
        name = name.strip().lower()
        if name == "content-length":
            length = int(value.strip())
        elif name == "transfer-encoding":
            chunked = True
        elif name == "connection":
            reuse = reuse and value.strip().lower() != "close"
        elif name == "content-type":
            media = value.partition(";")[0].strip().lower()
    if chunked:
        return status, None, False, media
    return status, length, reuse, media


class LaneClosed(Exception):
    """The direct lane is closed: before the request went out (`sent` False: nothing ran, use `/run`), or with
    the request in the worker (its process died)."""

    def __init__(self, *, sent: bool) -> None:
        super().__init__("the direct lane is closed")
        self.sent = sent


class DirectLane(asyncio.Protocol):
    """The invoker's end of a process container's direct lane: RUN frames to the worker the runtime proxy
    initialised and its answers back, without the proxy (docs/runtime.md, "The direct lane"). The worker holds
    the other end alone once initialised, so the lane closes exactly when that worker dies.

    An answer longer than the request's limit is read to its end but kept only up to the limit (memory stays
    bounded whatever the action returns); anything that is not a frame closes the lane."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        #: request id -> (future of (kind, kept payload, full length), bytes to keep)
        self._pending: dict[int, tuple[asyncio.Future[tuple[Kind, bytes, int]], int]] = {}
        self._next_id = 0
        #: the frame being skipped past its limit: (request id, kind, full length, bytes still to come)
        self._skipping: tuple[int, Kind, int, int] | None = None
        self._kept = bytearray()
        self.closed = False
        #: runs sent on the lane
        self.runs = 0

    @classmethod
    async def open(cls, sock: Any) -> DirectLane:
        lane = cls()
        await asyncio.get_running_loop().create_unix_connection(lambda: lane, sock=sock)
        return lane

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            self._parse()
        except ValueError:
            log.debug("runtime.lane_garbled")
            if self.transport is not None:
                self.transport.close()

    def _parse(self) -> None:
        buf = self._buf
        while True:
            if self._skipping is not None:
                request_id, kind, length, left = self._skipping
                take = min(left, len(buf))
                # `_kept` is sized to what is kept of the frame: filled in place, never grown (a stage frame's
                # tensor may weigh tens of MiB)
                at = length - left
                keep = min(take, len(self._kept) - at)
                if keep > 0:
                    with memoryview(buf) as view:
                        self._kept[at:at + keep] = view[:keep]
                del buf[:take]
                left -= take
                if left:
                    self._skipping = (request_id, kind, length, left)
                    return
                self._skipping = None
                kept, self._kept = self._kept, bytearray()
                self._deliver(request_id, kind, kept, length)
                continue
            if len(buf) < HEADER.size:
                return
            raw_kind, request_id, length = HEADER.unpack_from(buf)
            kind = Kind(raw_kind)  # ValueError: not one of ours
            if len(buf) - HEADER.size >= length:
                payload = bytes(buf[HEADER.size:HEADER.size + length])
                del buf[:HEADER.size + length]
                self._deliver(request_id, kind, payload[:self._limit_of(request_id)], length)
                continue
            del buf[:HEADER.size]
            self._skipping = (request_id, kind, length, length)
            self._kept = bytearray(min(length, self._limit_of(request_id)))

    def _limit_of(self, request_id: int) -> int:
        entry = self._pending.get(request_id)
        return entry[1] if entry is not None else 0

    def _deliver(self, request_id: int, kind: Kind, payload: bytes | bytearray, length: int) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is not None and not entry[0].done():
            # A long frame's payload is the bytearray it was read into: read as bytes are (sliced, decoded, parsed,
            # viewed), and not copied once more.
            entry[0].set_result((kind, cast(bytes, payload), length))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(LaneClosed(sent=True))

    async def request(self, payload: bytes | list[bytes], *, limit: int, kind: Kind = Kind.RUN) -> tuple[Kind, bytes, int]:
        """One RUN (or RUN_STAGE, its payload in parts): (answer kind, its payload up to `limit` bytes, the
        payload's full length)."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            raise LaneClosed(sent=False)
        self._next_id += 1
        request_id = self._next_id
        future: asyncio.Future[tuple[Kind, bytes, int]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, limit)
        try:
            for chunk in frame_chunks(kind, request_id, payload):
                transport.write(chunk)  # not `writelines`, which joins them first: a stage frame's blob is copied once
            self.runs += 1
            return await future
        finally:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class RuntimeClient:
    """Drives one runtime (one container or process) at `base_url`, e.g. `http://127.0.0.1:8080`.

    The session is the caller's (one per invoker is fine); keep-alive connections are reused.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        retry_interval_s: float = INIT_RETRY_INTERVAL_S,
        secret: str | None = None,
        alive: Callable[[], bool] | None = None,
        connections: RunConnections | None = None,
        stage_frames: bool = False,
        lane: DirectLane | None = None,
    ) -> None:
        self._session = session
        #: the container's direct lane for /run (process backend), tried before HTTP
        self._lane = lane
        #: the runtime takes stage frames over HTTP (its /init said so: `RuntimeOutcome.stage_frames`)
        self._stage_frames = stage_frames
        #: keep-alive connections for /run (only for the project's own runtime, see `RunConnections`)
        self._connections = connections
        #: whether the container still runs: /init stops retrying a connection to one that died
        self._alive = alive
        #: the container's runtime secret, sent with every request (X-Dilu-Runtime-Secret)
        self._secret = secret
        self._base_url = base_url.rstrip("/")
        self._max_result_bytes = max_result_bytes
        self._retry_interval_s = retry_interval_s

    @property
    def base_url(self) -> str:
        return self._base_url

    async def init(self, payload: Mapping[str, Any] | bytes, timeout_s: float) -> RuntimeOutcome:
        """POST /init, retrying a refused connection every 50 ms until `timeout_s` is used up, or until
        `alive` (the container's liveness, when the caller knows it) says the runtime is gone: a runtime
        that exited never listens, and waiting out the action's whole timeout for it holds a slot and the
        activation for nothing."""
        return await self._call("/init", payload, timeout_s, retry=True, mapping=init_outcome)

    async def run(self, payload: Mapping[str, Any] | bytes, timeout_s: float, *,
                  stage: bool | None = None) -> RuntimeOutcome:
        """POST /run once (never retried: the action may have started) — on the direct lane where the
        container has one open, else over HTTP. `stage` (a pipeline stage's run, `payload` its body as a
        mapping): the run goes as a stage frame — a RUN_STAGE on the lane, or over HTTP a body of
        `STAGE_CONTENT_TYPE` where the runtime takes them (`stage_frames`) — the tensor bytes at
        `value.dilu_stage.data` (a `Blob` or `BlobView`) as they are; True: every stage but the last, whose result
        may come back the same way (its `dilu_stage.data` then a `BlobView`). To any other runtime the body is JSON,
        a tensor in it base64, as without `stage`."""
        return await self._call("/run", payload, timeout_s, retry=False, mapping=run_outcome, stage=stage)

    async def _run_direct(self, lane: DirectLane, data: bytes | list[bytes], timeout_s: float,
                          kind: Kind = Kind.RUN) -> _Exchange | None:
        """The run on the lane, as the proxy would have answered it; None: the lane was closed before the
        request went out (nothing ran: the caller uses HTTP, where the proxy says what became of its worker)."""
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                kind, payload, length = await lane.request(data, limit=self._max_result_bytes, kind=kind)
        except TimeoutError:
            return _Exchange(None, b"", None, max(time.monotonic() - start, timeout_s))
        except LaneClosed as closed:
            if not closed.sent:
                return None
            # The worker died with the run in it: the proxy's answer to that over HTTP.
            body = error_body(MSG_EXITED)
            return _Exchange(400, body, len(body), time.monotonic() - start)
        if kind is Kind.RESULT_STAGE:
            return _Exchange(200, payload, length, time.monotonic() - start, staged=True)
        status, body = run_answer(kind, payload)
        return _Exchange(status, body, length if kind is Kind.RESULT else len(body), time.monotonic() - start)

    async def _call(self, path: str, payload: Mapping[str, Any] | bytes, timeout_s: float, *, retry: bool,
                    mapping: Callable[..., RuntimeOutcome], stage: bool | None = None) -> RuntimeOutcome:
        exchange = await self._post(path, payload, timeout_s, retry=retry, stage=stage)
        outcome = mapping(
            http_status=exchange.http_status,
            body=exchange.body,
            elapsed_s=exchange.elapsed_s,
            timeout_s=timeout_s,
            max_result_bytes=self._max_result_bytes,
            total_length=exchange.total_length,
            **({"staged": True} if exchange.staged else {}),
        )
        if exchange.stage_frames and outcome.ok:
            outcome = replace(outcome, stage_frames=True)
        log.debug(
            f"runtime{path.replace('/', '.')}",
            url=self._base_url,
            http_status=exchange.http_status,
            status=outcome.status_code.name,
            elapsed_s=round(exchange.elapsed_s, 6),
        )
        return outcome

    async def _post(self, path: str, payload: Mapping[str, Any] | bytes, timeout_s: float, *, retry: bool,
                    stage: bool | None = None) -> _Exchange:
        frame: list[bytes] | None = None
        if path == "/run" and stage is not None and not isinstance(payload, bytes) and (
                self._lane is not None or self._stage_frames):
            # A stage frame: the JSON of the body without the tensor bytes, then those bytes as they are.
            value, blob = take_blob(payload.get("value"))
            text = encode_body({**payload, "value": value} if blob is not None else payload)
            frame = pack_stage(text, blob, WELCOME_BLOB if stage else 0)
            if self._lane is not None:
                exchange = await self._run_direct(self._lane, frame, timeout_s, Kind.RUN_STAGE)
                if exchange is not None:
                    return exchange
                if not self._stage_frames:
                    frame = None
        if frame is not None and self._connections is not None and not retry:
            # (its parts written one after the other: the tensor's bytes are not copied into one body first)
            return await self._post_kept(path, frame, timeout_s, self._connections, STAGE_CONTENT_TYPE)
        content_type = "application/json"
        if frame is not None:
            data, content_type = b"".join(frame), STAGE_CONTENT_TYPE
        else:
            data = payload if isinstance(payload, bytes) else encode_body(payload)
        if self._lane is not None and path == "/run" and stage is None:
            exchange = await self._run_direct(self._lane, data, timeout_s)
            if exchange is not None:
                return exchange
        if self._connections is not None and not retry:
            return await self._post_kept(path, data, timeout_s, self._connections, content_type)
        url = self._base_url + path
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        if self._secret:
            headers["X-Dilu-Runtime-Secret"] = self._secret
        start = time.monotonic()
        while True:
            remaining = timeout_s - (time.monotonic() - start)
            if remaining <= 0:
                return _Exchange(None, b"", None, max(time.monotonic() - start, timeout_s))
            try:
                async with asyncio.timeout(remaining):
                    async with self._session.post(url, data=data, headers=headers, timeout=_NO_TIMEOUT) as response:
                        status = response.status
                        declared = response.content_length
                        if declared is None or declared <= 0:
                            # OpenWhisk's client treats an unknown or empty entity as no response.
                            return _Exchange(None, b"", None, time.monotonic() - start)
                        wanted = min(declared, self._max_result_bytes)
                        body = await response.content.readexactly(wanted)
                        if declared > wanted:
                            # Drop the connection instead of reading (maybe) gigabytes we will not use.
                            response.close()
                        return _Exchange(status, body, declared, time.monotonic() - start,
                                         staged=status == 200 and response.content_type == STAGE_CONTENT_TYPE,
                                         stage_frames=response.headers.get(STAGE_FRAMES_HEADER) == "1")
            except TimeoutError:
                return _Exchange(None, b"", None, max(time.monotonic() - start, timeout_s))
            except aiohttp.ClientConnectorError as exc:
                if not retry or (self._alive is not None and not self._alive()):
                    log.debug("runtime.connect_failed", url=url, error=str(exc))
                    return _Exchange(None, b"", None, time.monotonic() - start)
                # Not listening yet (container still starting): OpenWhisk retries every 50 ms.
                remaining = timeout_s - (time.monotonic() - start)
                await asyncio.sleep(max(0.0, min(self._retry_interval_s, remaining)))
            except (aiohttp.ClientError, asyncio.IncompleteReadError, OSError) as exc:
                log.debug("runtime.exchange_failed", url=url, error=str(exc))
                return _Exchange(None, b"", None, time.monotonic() - start)

    async def _post_kept(self, path: str, data: bytes | list[bytes], timeout_s: float, connections: RunConnections,
                         content_type: str = "application/json") -> _Exchange:
        """One POST on a kept connection (`RunConnections`), never retried; `data` the body, or its parts."""
        host, port = self.address
        secret = f"X-Dilu-Runtime-Secret: {self._secret}\r\n" if self._secret else ""
        parts = data if isinstance(data, list) else [data]
        length = sum(len(part) for part in parts)
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
                f"Accept: application/json\r\n{secret}Content-Length: {length}\r\n\r\n").encode()
        start = time.monotonic()
        conn: _Conn | None = None
        reuse = False
        try:
            async with asyncio.timeout(timeout_s):
                conn = await connections.acquire(host, port)
                for chunk in write_chunks(head, parts):
                    conn.writer.write(chunk)
                head = await conn.reader.readuntil(b"\r\n\r\n")
                status, declared, reuse, media = _parse_head(head)
                if declared is None or declared <= 0:
                    # OpenWhisk's client treats an unknown or empty entity as no response.
                    reuse = reuse and declared == 0
                    return _Exchange(None, b"", None, time.monotonic() - start)
                wanted = min(declared, self._max_result_bytes)
                body = await conn.reader.readexactly(wanted)
                # Past the limit: drop the connection instead of reading (maybe) gigabytes we will not use.
                reuse = reuse and declared == wanted
                return _Exchange(status, body, declared, time.monotonic() - start,
                                 staged=status == 200 and media == STAGE_CONTENT_TYPE)
        except TimeoutError:
            reuse = False
            return _Exchange(None, b"", None, max(time.monotonic() - start, timeout_s))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError) as exc:
            reuse = False
            log.debug("runtime.exchange_failed", url=self._base_url + path, error=str(exc))
            return _Exchange(None, b"", None, time.monotonic() - start)
        finally:
            if conn is not None:
                if reuse:
                    connections.release(host, port, conn)
                else:
                    conn.close()

    @property
    def address(self) -> tuple[str, int]:
        return url_address(self._base_url)


def url_address(url: str) -> tuple[str, int]:
    """(host, port) of a runtime's ``http://host:port`` (ValueError without a port)."""
    hostport = url.partition("://")[2].partition("/")[0]
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


# -- logs ---------------------------------------------------------------------------------------------


class LogSource(Protocol):
    """What the log reader reads: `asyncio.StreamReader` fits. `read` must be safe to cancel."""

    async def read(self, n: int = -1) -> bytes: ...


def format_timestamp(time_ns: int) -> str:
    seconds, nanos = divmod(time_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos:09d}Z"


def format_log_line(time_ns: int, stream: str, text: str) -> str:
    """A stored log line, as OpenWhisk formats it: `f"{time:<30} {stream}: {line}"`."""
    return f"{format_timestamp(time_ns):<30} {stream}: {text}"


@dataclass(frozen=True, slots=True)
class ActivationLogs:
    """One activation's log lines as OpenWhisk stores them, plus how collection went.

    `truncated`: the byte limit was hit (the truncation notice is the last collected line).
    `complete`: both streams showed the sentinel. Either flag false/true as an error is what OpenWhisk
    reports as a log collecting error.
    """

    lines: tuple[str, ...]
    truncated: bool = False
    complete: bool = True

    @property
    def collecting_error(self) -> bool:
        return self.truncated or not self.complete


_SENTINEL_BYTES = SENTINEL.encode()
_TAIL_BYTES = len(_SENTINEL_BYTES) + 1  # the sentinel plus a possible '\r'


@dataclass(slots=True)
class _StreamState:
    """What survives between collections for one stream: unread bytes and an unfinished line."""

    name: str
    source: LogSource
    pending: bytes = b""  # read from the source but belonging to a later activation
    head: bytearray = field(default_factory=bytearray)  # kept bytes of the unfinished line
    line_bytes: int = 0  # length of the unfinished line, kept or not
    tail: bytes = b""  # last bytes of an unfinished line that is too long to keep
    dropping: bool = False  # the unfinished line is longer than the remaining budget
    eof: bool = False


class _Collector:
    def __init__(self, limit_bytes: int, clock_ns: Callable[[], int]) -> None:
        self.limit_bytes = max(0, limit_bytes)
        self.clock_ns = clock_ns
        self.used = 0
        self.truncated = False
        self.lines: list[str] = []

    def room(self) -> int:
        return 0 if self.truncated else self.limit_bytes - self.used

    def add(self, stream: str, line: bytes) -> None:
        if self.truncated:
            return
        cost = len(line) + 1  # the newline counts, as in OpenWhisk's limitWeighted stage
        if self.used + cost > self.limit_bytes:
            self.truncated = True
            return
        self.used += cost
        self.lines.append(format_log_line(self.clock_ns(), stream, line.decode("utf-8", "replace")))

    def drop(self) -> None:
        self.truncated = True


def _strip_line_end(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\r") else line


async def _read_until_sentinel(state: _StreamState, collector: _Collector, chunk_bytes: int) -> bool:
    """Consume one stream up to and including its next sentinel line; True if it was seen."""
    while True:
        if state.pending:
            chunk, state.pending = state.pending, b""
        elif state.eof:
            return False
        else:
            chunk = await state.source.read(chunk_bytes)
            if not chunk:
                state.eof = True
                if state.line_bytes:
                    _finish_line(state, collector)
                return False
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            end = len(chunk) if newline < 0 else newline
            _extend_line(state, collector, chunk[start:end])
            if newline < 0:
                break
            start = newline + 1
            if _finish_line(state, collector):
                state.pending = chunk[start:]
                return True


def _extend_line(state: _StreamState, collector: _Collector, piece: bytes) -> None:
    if not piece:
        return
    state.line_bytes += len(piece)
    # A sentinel-sized line is always kept whole, so the sentinel is recognised even past the limit.
    if not state.dropping and state.line_bytes <= max(collector.room(), _TAIL_BYTES):
        state.head += piece
        return
    # Too long to keep: remember only enough of its end to recognise a sentinel.
    if not state.dropping:
        state.dropping = True
        state.tail = bytes(state.head[-_TAIL_BYTES:])
        state.head = bytearray()
    state.tail = (state.tail + piece)[-_TAIL_BYTES:]


def _finish_line(state: _StreamState, collector: _Collector) -> bool:
    """Account the finished line; True if it carried the sentinel."""
    dropping, line = state.dropping, bytes(state.head)
    end = _strip_line_end(state.tail if dropping else line)
    state.head, state.line_bytes, state.tail, state.dropping = bytearray(), 0, b"", False
    is_sentinel = end.endswith(_SENTINEL_BYTES)
    if dropping:
        # Part of the line was never kept; even its sentinel-free prefix is lost.
        collector.drop()
        return is_sentinel
    text = _strip_line_end(line)
    if is_sentinel:
        # Output without a final newline shares the sentinel's line; keep the user's part.
        text = text[: -len(_SENTINEL_BYTES)]
        if text:
            collector.add(state.name, text)
        return True
    collector.add(state.name, text)
    return False


class LogCollection:
    """One activation's log collection, already reading; finish it once the /init or /run has answered."""

    def __init__(self, reader: ActivationLogReader, collector: _Collector) -> None:
        self._reader = reader
        self._collector = collector
        self._seen = {"stdout": False, "stderr": False}
        # One task per stream (not one gathering two): three tasks per activation cost more than two.
        self._tasks = (asyncio.create_task(self._pump(reader.stdout)), asyncio.create_task(self._pump(reader.stderr)))

    async def _pump(self, state: _StreamState) -> None:
        self._seen[state.name] = await _read_until_sentinel(state, self._collector, self._reader.chunk_bytes)

    async def finish(
        self, *, developer_error: bool = False, timeout_s: float = 2.0, settle_s: float = 0.1
    ) -> ActivationLogs:
        """Wait for both sentinels (`timeout_s`; only `settle_s` after a developer error, since a broken
        runtime may never write them), stop reading and return the lines with OpenWhisk's notices."""
        wait_s = settle_s if developer_error else timeout_s
        tasks = self._tasks
        try:
            if not (tasks[0].done() and tasks[1].done()):
                await asyncio.wait(tasks, timeout=max(wait_s, 0.0))
        finally:
            # Stop reading even when our caller is cancelled: the next collection owns the streams.
            reading = [task for task in tasks if not task.done()]
            for task in reading:
                task.cancel()
            if reading:
                await asyncio.wait(reading)
            self._reader._active = None
        for task in tasks:
            if not task.cancelled() and (error := task.exception()) is not None:
                log.warning("runtime.log_read_failed", error=repr(error))
        return self._result(developer_error)

    def _result(self, developer_error: bool) -> ActivationLogs:
        collector = self._collector
        lines = list(collector.lines)
        complete = all(self._seen.values())
        now = collector.clock_ns()
        if collector.truncated:
            lines.append(format_log_line(now, "stderr", truncated_logs_message(collector.limit_bytes)))
        elif not complete and not developer_error:
            lines.append(format_log_line(now, "stderr", MSG_LOG_FAILURE))
        if developer_error:
            lines.append(format_log_line(now, "stderr", MSG_LOG_DEVELOPER_ERROR))
        return ActivationLogs(lines=tuple(lines), truncated=collector.truncated, complete=complete)


class ActivationLogReader:
    """Splits a runtime's stdout and stderr into per-activation logs at the sentinels.

    One reader per runtime, kept for the runtime's life: bytes read past one activation's sentinel are
    kept for the next. Memory stays bounded by the log limit plus one read chunk per stream: past the
    limit lines are dropped, but the reader keeps scanning for the sentinel.

    With pipes (the process backend) a collection must be running while the action runs, or a chatty
    action blocks on a full pipe::

        collection = reader.start(limit_bytes=action_logs_mb * 1024 * 1024)
        outcome = await client.run(body, timeout_s)
        logs = await collection.finish(developer_error=outcome.status_code == ActivationStatus.DEVELOPER_ERROR)

    Call it for every `/run` and every failed `/init` (a successful `/init` writes no sentinel; its output
    belongs to the first run's logs). With `limits.concurrency > 1`, frames close in completion order and
    lines of overlapping activations may land in either one's logs.
    """

    def __init__(
        self,
        stdout: LogSource,
        stderr: LogSource,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        chunk_bytes: int = 64 * 1024,
    ) -> None:
        self.stdout = _StreamState("stdout", stdout)
        self.stderr = _StreamState("stderr", stderr)
        self.clock_ns = clock_ns
        self.chunk_bytes = chunk_bytes
        self._active: LogCollection | None = None

    def start(self, *, limit_bytes: int) -> LogCollection:
        if self._active is not None:
            raise RuntimeError("a log collection is already running on this runtime")
        self._active = LogCollection(self, _Collector(limit_bytes, self.clock_ns))
        return self._active

    async def collect(
        self, *, limit_bytes: int, developer_error: bool = False, timeout_s: float = 2.0, settle_s: float = 0.1
    ) -> ActivationLogs:
        """Start and finish in one step, for when the output is already written (e.g. docker's log file)."""
        collection = self.start(limit_bytes=limit_bytes)
        return await collection.finish(developer_error=developer_error, timeout_s=timeout_s, settle_s=settle_s)
