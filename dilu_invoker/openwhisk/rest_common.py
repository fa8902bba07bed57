"""What every handler of the standalone REST API shares: typed app keys, OpenWhisk's error shape and
messages, the transaction id, authentication, namespace resolution, query and body parsing."""

from __future__ import annotations

import asyncio
import contextvars
import io
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from dilu_invoker import jsonutil
from dilu_invoker.config import ApiConfig
from dilu_invoker.health import unhealthy_reason
from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import (
    ENTITY_NAME_MAX,
    ENTITY_NAME_RE,
    Identity,
    JsonValue,
    new_transid,
)
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.store import STORE_UNAVAILABLE, EntityStore

log = structlog.get_logger(__name__)

CONFIG = web.AppKey("config", ApiConfig)
STORE = web.AppKey("store", EntityStore)
RUNNER = web.AppKey("runner", ActivationRunner)
MANIFEST = web.AppKey("manifest", Manifest)
AUTH = web.AppKey("auth", Authenticator)
#: activations still running after their request was answered (non-blocking, or past the blocking wait)
TASKS: web.AppKey[set[asyncio.Task[Any]]] = web.AppKey("tasks")

#: the transaction id of the request being handled, ``[id, start ms]`` as OpenWhisk serializes it
TRANSID: contextvars.ContextVar[list[JsonValue]] = contextvars.ContextVar("transid")

#: OpenWhisk's list bounds (``Collection.MAX_LIST_LIMIT``, ``defaultListLimit``)
MAX_LIST_LIMIT = 200
DEFAULT_LIST_LIMIT = 30


class Msg:
    """OpenWhisk's user-facing messages (``org.apache.openwhisk.http.Messages`` and akka-http defaults)."""

    NOT_FOUND = "The requested resource does not exist."
    ROUTE_NOT_FOUND = "The requested resource could not be found."
    AUTH_MISSING = "The resource requires authentication, which was not supplied with the request"
    AUTH_INVALID = "The supplied authentication is invalid"
    EXISTS = "resource already exists"
    CONFLICT = "Concurrent modification to resource detected."
    EXEC_UNDEFINED = "exec undefined"
    ENTITY_NAME_ILLEGAL = "The name of the entity contains illegal characters."
    NAMESPACE_ILLEGAL = "The namespace contains illegal characters."
    ACTIVATION_ID_ILLEGAL = "The activation id is not valid."
    PARAMETERS_NOT_ALLOWED = "Request defines parameters that are not allowed (e.g., reserved properties)."
    DOCS_NOT_ALLOWED_WITH_COUNT = "The parameter 'docs' is not permitted with 'count'."
    OVERLOADED = "System is overloaded, try again later."
    INTERNAL = "There was an internal server error."

    @staticmethod
    def forbidden(resource: str) -> str:
        return f"The supplied authentication is not authorized to access '{resource}'."

    @staticmethod
    def too_big(field: str, size: int, allowed: int) -> str:
        return f"{field} larger than allowed: {size} > {allowed} bytes."

    @staticmethod
    def name_too_long(size: int) -> str:
        return f"Name longer than allowed: {size} > {ENTITY_NAME_MAX}."

    @staticmethod
    def activation_id_length(size: int) -> str:
        return f"Activation id length is {size} but must be 32."

    @staticmethod
    def limit_out_of_range(collection: str, value: int) -> str:
        return f"The value '{value}' is not in the range of 0 to {MAX_LIST_LIMIT} for {collection}."

    @staticmethod
    def skip_out_of_range(collection: str, value: int) -> str:
        return f"The value '{value}' is not greater than or equal to 0 for {collection}."

    @staticmethod
    def not_integer(collection: str, value: str) -> str:
        return f"The value '{value}' is not an integer for {collection}."

    @staticmethod
    def bad_name_filter(value: str) -> str:
        return f"Parameter may be a 'simple' name or 'package-name/simple' name: {value}"

    @staticmethod
    def bad_epoch(value: str) -> str:
        return f"Parameter is not a valid value for epoch seconds: {value}"

    @staticmethod
    def invalid_timeout(max_ms: int) -> str:
        return f"Timeout must be number of milliseconds up to {max_ms}."

    @staticmethod
    def malformed_query(name: str, value: str, kind: str) -> str:
        return f"The query parameter '{name}' was malformed:\n'{value}' is not a valid {kind} value"

    @staticmethod
    def runtime_deprecated(kind: str) -> str:
        return (f"The '{kind}' runtime is no longer supported. You may read and delete but not update "
                "or invoke this action.")


class ApiError(Exception):
    """Answered as ``{"error": message, "code": transid}`` with ``status``."""

    def __init__(self, status: int, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


def transid_id() -> str:
    tid = TRANSID.get(None)
    return str(tid[0]) if tid else ""


_STREAM_BYTES = 512 * 1024


def json_response(
    body: JsonValue, *, status: int = 200, headers: Mapping[str, str] | None = None, encoded: bytes | None = None
) -> web.Response:
    data = encoded if encoded is not None else jsonutil.dumps(body)
    # aiohttp streams a file-like body in chunks instead of handing one huge buffer to the transport.
    payload: bytes | io.BytesIO = io.BytesIO(data) if len(data) > _STREAM_BYTES else data
    return web.Response(body=payload, status=status, content_type="application/json", headers=headers)


def error_response(status: int, message: str, *, headers: Mapping[str, str] | None = None) -> web.Response:
    return json_response({"error": message, "code": transid_id()}, status=status, headers=headers)


# --------------------------------------------------------------------------------------------
# Middleware
# --------------------------------------------------------------------------------------------

_REQUEST_ID_RE = re.compile(r"\A[A-Za-z0-9._:-]{1,128}\Z")
_CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, DELETE, POST, PUT, HEAD, PATCH",
    "Access-Control-Allow-Headers": "Authorization, Origin, X-Requested-With, Content-Type, Accept, User-Agent",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openwhisk_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Assigns the transaction id (``X-Request-ID``, as OpenWhisk's controller), turns every failure of
    one request into an OpenWhisk error body for that request only, and adds the CORS headers."""
    incoming = request.headers.get("X-Request-ID", "")
    tid = new_transid()
    if _REQUEST_ID_RE.match(incoming):
        tid[0] = incoming
    TRANSID.set(tid)
    # Bound for this request's task and reset after (cheaper than bound_contextvars, which copies the whole
    # context to save what it replaces).
    tokens = structlog.contextvars.bind_contextvars(transid=tid[0])
    try:
        unhealthy = unhealthy_reason(request.app)
        response: web.StreamResponse
        # CORS preflight for any path, as OpenWhisk answers it
        if request.method == "OPTIONS":
            response = web.Response()
        elif unhealthy is not None:
            # Redis is down: answer at once instead of waiting on it, and say so at the root.
            message = f"System is unhealthy: {unhealthy}." if request.path == "/" else Msg.OVERLOADED
            response = error_response(503, message)
        else:
            response = await handler(request)
    except ApiError as exc:
        response = error_response(exc.status, exc.message, headers=exc.headers)
    except web.HTTPException as exc:
        response = _from_http_exception(exc)
    except asyncio.CancelledError:
        raise
    except STORE_UNAVAILABLE as exc:
        # Redis is down, restarting, or every pooled connection stayed busy past the pool timeout:
        # the client may retry, so this is OpenWhisk's overload answer, never a 500.
        _store_unavailable_log.note(exc, method=request.method, path=request.path)
        response = error_response(503, Msg.OVERLOADED)
    except Exception:
        log.exception("request failed", method=request.method, path=request.path)
        response = error_response(500, Msg.INTERNAL)
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
    response.headers["X-Request-ID"] = str(tid[0])
    for k, v in _CORS.items():
        response.headers.setdefault(k, v)
    return response


class _RateLimitedWarning:
    """One warning per ``period_s`` with the count of the ones left out: a dead Redis under load would
    otherwise write hundreds of identical lines a second."""

    def __init__(self, event: str, period_s: float = 1.0) -> None:
        self.event = event
        self.period_s = period_s
        self._last = float("-inf")
        self._suppressed = 0

    def note(self, exc: BaseException, **fields: object) -> None:
        now = asyncio.get_running_loop().time()
        if now - self._last < self.period_s:
            self._suppressed += 1
            return
        log.warning(self.event, error=f"{type(exc).__name__}: {exc}", suppressed=self._suppressed, **fields)
        self._last = now
        self._suppressed = 0


_store_unavailable_log = _RateLimitedWarning("redis unavailable, answered 503")


def _from_http_exception(exc: web.HTTPException) -> web.StreamResponse:
    if exc.status < 400:
        return exc
    if exc.status == 404:
        message = Msg.ROUTE_NOT_FOUND
    elif exc.status == 405 and isinstance(exc, web.HTTPMethodNotAllowed):
        message = "HTTP method not allowed, supported methods: " + ", ".join(sorted(exc.allowed_methods))
    elif exc.status == 413:
        message = "The request content was too large."
    else:
        message = exc.reason
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
    return error_response(exc.status, message, headers=headers)


# --------------------------------------------------------------------------------------------
# aiohttp's own error answers (requests that never reach a handler or the middleware)
# --------------------------------------------------------------------------------------------


class _OpenWhiskErrorsRequestHandler(RequestHandler):
    """aiohttp answers a request it cannot parse (header line too long, bad method token, broken
    framing) itself, in plain text and before any middleware runs. This handler gives those answers
    OpenWhisk's JSON error shape, keeping aiohttp's status, logging and connection handling."""

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)
        if status == 500:
            text = Msg.INTERNAL
        else:
            reason = (str(exc) if exc is not None and str(exc) else message or "").strip().splitlines()
            text = "The request could not be parsed" + (f": {reason[0]}" if reason else ".")
        body = jsonutil.dumps({"error": text, "code": str(new_transid()[0])})
        response = web.Response(body=body, status=plain.status, content_type="application/json")
        response.force_close()
        return response


class _OpenWhiskErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _OpenWhiskErrorsRequestHandler(self, loop=self._loop, **self._kwargs)


class ApiAppRunner(web.AppRunner):
    """:class:`aiohttp.web.AppRunner` whose connections answer aiohttp's own errors in OpenWhisk's shape."""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _OpenWhiskErrorsServer(plain.request_handler, request_factory=plain.request_factory,
                                      handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                                      **plain._kwargs)


async def serve_api(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve the REST app on ``host:port`` (0: a free port); returns the runner and the bound port."""
    runner = ApiAppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = port
    for sock in getattr(site._server, "sockets", None) or ():
        bound = int(sock.getsockname()[1])
        break
    return runner, bound


# --------------------------------------------------------------------------------------------
# Authentication and namespaces
# --------------------------------------------------------------------------------------------

_CHALLENGE = {"WWW-Authenticate": 'Basic realm="whisk rest service"'}


def authenticate(request: web.Request) -> Identity:
    header = request.headers.get("Authorization")
    if not header:
        raise ApiError(401, Msg.AUTH_MISSING, headers=_CHALLENGE)
    identity = request.app[AUTH].authenticate_header(header)
    if identity is None:
        raise ApiError(401, Msg.AUTH_INVALID, headers=_CHALLENGE)
    return identity


def valid_entity_name(name: str) -> bool:
    return len(name) <= ENTITY_NAME_MAX and ENTITY_NAME_RE.match(name) is not None


def check_entity_name(name: str) -> str:
    if len(name) > ENTITY_NAME_MAX:
        raise ApiError(400, Msg.name_too_long(len(name)))
    if not ENTITY_NAME_RE.match(name):
        raise ApiError(400, Msg.ENTITY_NAME_ILLEGAL)
    return name


def resolve_namespace(identity: Identity, segment: str, resource: str) -> str:
    """``_`` is the caller's namespace; another namespace is refused as OpenWhisk's entitlement check
    refuses it (403 naming ``resource``, e.g. ``ns/actions/name``)."""
    if segment == "_":
        return identity.namespace
    if not valid_entity_name(segment):
        raise ApiError(400, Msg.NAMESPACE_ILLEGAL)
    if segment != identity.namespace:
        raise ApiError(403, Msg.forbidden(f"{segment}/{resource}"))
    return segment


# --------------------------------------------------------------------------------------------
# Query parameters
# --------------------------------------------------------------------------------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def query_bool(request: web.Request, name: str, default: bool = False) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ApiError(400, Msg.malformed_query(name, raw, "Boolean"))


def query_limit(request: web.Request, collection: str) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return DEFAULT_LIST_LIMIT
    try:
        n = int(raw)
    except ValueError:
        raise ApiError(400, Msg.not_integer(collection, raw)) from None
    if n == 0:
        return MAX_LIST_LIMIT
    if not 0 < n <= MAX_LIST_LIMIT:
        raise ApiError(400, Msg.limit_out_of_range(collection, n))
    return n


#: OpenWhisk reads ``skip`` as a 32-bit integer; anything larger is "not an integer" there too
MAX_SKIP = 2**31 - 1


def query_skip(request: web.Request, collection: str) -> int:
    raw = request.query.get("skip")
    if raw is None:
        return 0
    try:
        n = int(raw)
    except ValueError:
        raise ApiError(400, Msg.not_integer(collection, raw)) from None
    if n > MAX_SKIP:
        raise ApiError(400, Msg.not_integer(collection, raw))
    if n < 0:
        raise ApiError(400, Msg.skip_out_of_range(collection, n))
    return n


# --------------------------------------------------------------------------------------------
# Bodies
# --------------------------------------------------------------------------------------------

_CHUNK = 256 * 1024


async def read_body(request: web.Request, limit: int) -> bytes | bytearray:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes: from the
    ``Content-Length`` before anything is read, else while streaming (nothing past the limit is kept)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise ApiError(413, Msg.too_big("Request", declared, limit))
    # One growing buffer rather than a list of chunks joined at the end: a 48 MB body is not held twice.
    body = bytearray()
    async for chunk in request.content.iter_chunked(_CHUNK):
        if len(body) + len(chunk) > limit:
            raise ApiError(413, Msg.too_big("Request", len(body) + len(chunk), limit))
        body += chunk
    return bytes(body) if len(body) <= _CHUNK else body


#: deepest nesting of arrays and objects a request body may have (``docs/rest-api.md``, "Errors")
MAX_JSON_DEPTH = 100


def nesting_exceeds(value: JsonValue, limit: int) -> bool:
    """True when arrays and objects in ``value`` nest deeper than ``limit`` (iterative: no recursion).

    The cost follows the number of containers, not the bytes: a 48 MB code string is one leaf."""
    stack: list[tuple[JsonValue, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[JsonValue] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


async def parse_json_body(body: bytes | bytearray, *, max_depth: int = MAX_JSON_DEPTH) -> JsonValue:
    """``None`` for an empty body; 400 in OpenWhisk's wording for anything that is not JSON, or that nests
    arrays and objects deeper than ``max_depth``."""
    if not body or body.isspace():
        return None
    too_deep = ApiError(400, f"The request content was malformed: JSON nested deeper than {max_depth} levels.")
    try:
        value = await jsonutil.aloads(body)
    except UnicodeDecodeError:
        raise ApiError(400, "The request content was malformed: the body is not UTF-8 text.") from None
    except RecursionError:
        # Far deeper than the bound: the parser's own recursion guard gave up.
        raise too_deep from None
    except ValueError as exc:
        raise ApiError(400, f"The request content was malformed: {exc}") from None
    deep = (await asyncio.to_thread(nesting_exceeds, value, max_depth) if len(body) > jsonutil.OFFLOAD_BYTES
            else nesting_exceeds(value, max_depth))
    if deep:
        raise too_deep
    return value
