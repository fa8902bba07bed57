"""OpenWhisk's CouchDB databases, as the invoker uses them (``reference/openwhisk.md`` §3).

* :class:`CouchClient`: a small aiohttp client. Always authenticated (pouchdb-server, which the tests
  use, crashes on some anonymous writes), always ``Accept: application/json``, path segments
  percent-encoded (``guest/hello`` → ``guest%2Fhello``). It tracks whether the server answered the last
  request, which the pinger uses to stop pinging while the database is unusable.
* :class:`ActionStore`: reads ``{prefix}whisks`` documents at the requested revision, resolves the code
  attachment (``mem:`` inline, ``couch:<uuid>``, legacy names), converts the document to
  :class:`~dilu_invoker.model.Action` and caches it by revision. Failures come out as
  :class:`ActionFetchError` subclasses that carry the exact response the Scala invoker would give.
* :class:`ActivationStore`: writes ``{prefix}activations`` records idempotently (a 409 for the same id is
  success) and answers "is this activation already recorded?" for redelivered messages.

Both stores retry an unreachable database with backoff up to a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self, TypeVar

import aiohttp
import structlog
import yarl

from dilu_invoker.config import CouchConfig
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import (
    Action,
    Activation,
    ActivationResponse,
    JsonValue,
    ValidationError,
    is_binary_code,
)
from dilu_invoker.openwhisk.backoff import Backoff, sleep_or_stop
from dilu_invoker.openwhisk.messages import activation_doc_id, activation_document

log = structlog.get_logger(__name__)

_FETCH_BACKOFF = Backoff(initial_s=0.1, maximum_s=2.0)
_STORE_BACKOFF = Backoff(initial_s=0.1, maximum_s=5.0)

T = TypeVar("T")


class CouchError(Exception):
    pass


class CouchUnavailable(CouchError):
    """No answer, a timeout or a 5xx: the database may come back; retry."""


class DocumentNotFound(CouchError):
    pass


class DocumentConflict(CouchError):
    pass


class CouchRequestFailed(CouchError):
    """A 4xx other than 404/409 (bad credentials, bad request): retrying will not help."""


class CouchClient:
    def __init__(self, cfg: CouchConfig, *, timeout_s: float = 10.0) -> None:
        if not cfg.host:
            raise ValueError("CouchDB host is not set (--couchdb-host / CONFIG_whisk_couchdb_host)")
        self.cfg = cfg
        self.base = f"{cfg.protocol}://{cfg.host}:{cfg.port}"
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = {"Accept": "application/json"}
        if cfg.username:
            token = base64.b64encode(f"{cfg.username}:{cfg.password or ''}".encode()).decode("ascii")
            self._headers["Authorization"] = f"Basic {token}"
        self._session: aiohttp.ClientSession | None = None
        #: did the server answer the last request (any status below 500)?
        self.available = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _session_(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout,
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=64),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, *segments: str, params: Mapping[str, str] | None = None) -> yarl.URL:
        path = "/".join(urllib.parse.quote(s, safe="") for s in segments)
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return yarl.URL(f"{self.base}/{path}{query}", encoded=True)

    async def request(
        self,
        method: str,
        *segments: str,
        params: Mapping[str, str] | None = None,
        body: JsonValue = None,
        data: bytes | None = None,
        content_type: str | None = None,
    ) -> tuple[int, bytes]:
        headers: dict[str, str] = {}
        payload: bytes | None = data
        if body is not None:
            payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            headers["Content-Type"] = "application/json"
        elif content_type is not None:
            headers["Content-Type"] = content_type
        url = self.url(*segments, params=params)
        try:
            async with self._session_().request(method, url, data=payload, headers=headers) as resp:
                content = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.available = False
            raise CouchUnavailable(f"{method} {url.path}: {exc!r}") from exc
        if status >= 500:
            self.available = False
            raise CouchUnavailable(f"{method} {url.path}: HTTP {status} {content[:200]!r}")
        self.available = True
        return status, content

    @staticmethod
    def _json(content: bytes) -> Any:
        try:
            return json.loads(content)
        except ValueError as exc:
            raise CouchRequestFailed(f"not JSON: {content[:200]!r}") from exc

    def _fail(self, what: str, status: int, content: bytes) -> CouchError:
        if status == 404:
            return DocumentNotFound(what)
        if status == 409:
            return DocumentConflict(what)
        return CouchRequestFailed(f"{what}: HTTP {status} {content[:300]!r}")

    async def get_doc(self, db: str, doc_id: str, *, rev: str | None = None) -> dict[str, Any]:
        status, content = await self.request("GET", db, doc_id, params={"rev": rev} if rev else None)
        if status != 200:
            raise self._fail(f"{db}/{doc_id}", status, content)
        doc = self._json(content)
        if not isinstance(doc, dict) or doc.get("_deleted"):
            raise DocumentNotFound(f"{db}/{doc_id}")
        return doc

    async def get_attachment(self, db: str, doc_id: str, name: str, *, rev: str | None = None) -> bytes:
        status, content = await self.request("GET", db, doc_id, name, params={"rev": rev} if rev else None)
        if status != 200:
            raise self._fail(f"{db}/{doc_id}/{name}", status, content)
        return content

    async def put_doc(self, db: str, doc_id: str, doc: Mapping[str, JsonValue]) -> str:
        status, content = await self.request("PUT", db, doc_id, body=dict(doc))
        if status not in (200, 201, 202):
            raise self._fail(f"{db}/{doc_id}", status, content)
        return str(self._json(content).get("rev", ""))

    async def put_attachment(self, db: str, doc_id: str, name: str, data: bytes, *, rev: str,
                             content_type: str) -> str:
        status, content = await self.request("PUT", db, doc_id, name, params={"rev": rev}, data=data,
                                             content_type=content_type)
        if status not in (200, 201, 202):
            raise self._fail(f"{db}/{doc_id}/{name}", status, content)
        return str(self._json(content).get("rev", ""))

    async def create_db(self, db: str) -> None:
        status, content = await self.request("PUT", db)
        if status not in (201, 202, 412):
            raise self._fail(db, status, content)

    async def probe(self, *dbs: str) -> str | None:
        """None when every database answers to these credentials; otherwise why not."""
        for db in dbs:
            try:
                status, content = await self.request("GET", db)
            except CouchUnavailable as exc:
                return str(exc)
            if status != 200:
                self.available = False
                return f"GET /{db}: HTTP {status} {content[:200]!r}"
        return None


async def with_retries(
    op: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    deadline_s: float,
    stop: asyncio.Event | None = None,
    what: str,
) -> T:
    """Run ``op``, retrying :class:`CouchUnavailable` with backoff until ``deadline_s`` has passed."""
    give_up_at = time.monotonic() + deadline_s
    attempt = 0
    for delay in backoff.delays():
        try:
            return await op()
        except CouchUnavailable as exc:
            attempt += 1
            remaining = give_up_at - time.monotonic()
            if remaining <= 0:
                log.error("couchdb.gave_up", what=what, attempts=attempt, error=str(exc))
                raise
            if attempt == 1 or attempt % 20 == 0:
                log.warning("couchdb.retry", what=what, attempt=attempt, error=str(exc))
            if await sleep_or_stop(min(delay, remaining), stop):
                raise
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# Actions (whisks database)
# --------------------------------------------------------------------------------------------

#: ``Messages`` in ``common/.../http/ErrorResponse.scala``
ACTION_REMOVED = "Action could not be found or may have been deleted."
ACTION_MISMATCH = "Action version is not compatible and cannot be invoked."
ACTION_FETCH_ERROR = "Action could not be fetched."


class ActionFetchError(Exception):
    """Why an action could not be read, with the response ``InvokerReactive`` answers in that case."""

    response: ActivationResponse

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ActionNotFound(ActionFetchError):
    response = ActivationResponse.application_error(ACTION_REMOVED)


class ActionIncompatible(ActionFetchError):
    """Unreadable document or a kind this invoker's manifest does not know (a whisk error)."""

    response = ActivationResponse.whisk_error(ACTION_MISMATCH)


class ActionFetchFailed(ActionFetchError):
    response = ActivationResponse.whisk_error(ACTION_FETCH_ERROR)


_SCHEME_RE = re.compile(r"\A([a-zA-Z][a-zA-Z0-9+.-]*):")
_BLACKBOX = "blackbox"
_SEQUENCE = "sequence"


class _ActionCache:
    """LRU of converted actions by (document id, revision), bounded by the size of their code."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], tuple[Action, int]] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[str, str]) -> Action | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: tuple[str, str], action: Action) -> None:
        size = 1024 + len(action.exec.code or "")
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._entries[key] = (action, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)


class ActionStore:
    def __init__(
        self,
        client: CouchClient,
        db: str,
        *,
        manifest: Manifest,
        backoff: Backoff = _FETCH_BACKOFF,
        deadline_s: float = 60.0,
        cache_bytes: int = 256 * 1024 * 1024,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.client = client
        self.db = db
        self.manifest = manifest
        self.backoff = backoff
        self.deadline_s = deadline_s
        self.stop = stop
        self._cache = _ActionCache(cache_bytes)
        self.fetches = 0

    async def _retry(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        return await with_retries(op, backoff=self.backoff, deadline_s=self.deadline_s, stop=self.stop, what=what)

    async def get(self, path: str, name: str, revision: str | None) -> Action:
        """The action ``path/name`` at ``revision`` (the latest if None or no longer stored)."""
        doc_id = f"{path}/{name}"
        if revision:
            cached = self._cache.get((doc_id, revision))
            if cached is not None:
                return cached
        try:
            try:
                doc = await self._retry(lambda: self.client.get_doc(self.db, doc_id, rev=revision), doc_id)
            except DocumentNotFound:
                if not revision:
                    raise
                # InvokerReactive: on a revision mismatch the action may have been updated; read the latest.
                doc = await self._retry(lambda: self.client.get_doc(self.db, doc_id), doc_id)
            self.fetches += 1
            action = await self._convert(doc_id, doc)
        except DocumentNotFound as exc:
            raise ActionNotFound(str(exc)) from exc
        except (CouchUnavailable, CouchRequestFailed) as exc:
            raise ActionFetchFailed(str(exc)) from exc
        if action.revision:
            self._cache.put((doc_id, action.revision), action)
        return action

    async def _convert(self, doc_id: str, doc: Mapping[str, Any]) -> Action:
        entity_type = doc.get("entityType", "action")
        exec_ = doc.get("exec")
        if entity_type != "action" or not isinstance(exec_, Mapping):
            raise ActionIncompatible(f"{doc_id} is not an action (entityType {entity_type!r})")
        kind = exec_.get("kind")
        if not isinstance(kind, str) or not kind:
            raise ActionIncompatible(f"{doc_id}: exec has no kind")
        kind = kind.lower()
        if kind == _SEQUENCE:
            # The controller runs sequences itself; one reaching an invoker cannot be executed here.
            raise ActionIncompatible(f"{doc_id}: a sequence reached the invoker")
        if kind != _BLACKBOX and self.manifest.resolve(kind) is None:
            raise ActionIncompatible(f"{doc_id}: kind {kind!r} is not in this invoker's runtimes manifest")
        code, binary = await self._code(doc_id, doc, exec_)
        exec_json: dict[str, Any] = {"kind": kind, "binary": binary}
        if code is not None:
            exec_json["code"] = code
        for key in ("main", "image"):
            if exec_.get(key) is not None:
                exec_json[key] = exec_[key]
        try:
            return Action.from_json({**doc, "exec": exec_json})
        except (ValidationError, KeyError, TypeError, ValueError) as exc:
            raise ActionIncompatible(f"{doc_id}: {exc}") from exc

    async def _code(self, doc_id: str, doc: Mapping[str, Any], exec_: Mapping[str, Any]) -> tuple[str | None, bool]:
        code = exec_.get("code", exec_.get("jar"))  # very old documents used "jar"
        flag = exec_.get("binary")
        if code is None:
            return None, bool(flag) if isinstance(flag, bool) else False
        if isinstance(code, str):
            return code, flag if isinstance(flag, bool) else is_binary_code(code)
        if not isinstance(code, Mapping) or not isinstance(code.get("attachmentName"), str):
            raise ActionIncompatible(f"{doc_id}: exec.code is neither a string nor an attachment")
        content_type = str(code.get("attachmentType", ""))
        binary = flag if isinstance(flag, bool) else content_type.startswith("application/octet-stream")
        raw = await self._attachment(doc_id, doc, code["attachmentName"])
        if binary:
            # The attachment holds the raw bytes (a zip); /init wants them base64-encoded.
            return base64.b64encode(raw).decode("ascii"), True
        try:
            return raw.decode("utf-8"), False
        except UnicodeDecodeError as exc:
            raise ActionIncompatible(f"{doc_id}: text code is not UTF-8") from exc

    async def _attachment(self, doc_id: str, doc: Mapping[str, Any], name: str) -> bytes:
        scheme_match = _SCHEME_RE.match(name)
        scheme = scheme_match.group(1).lower() if scheme_match else None
        if scheme == "mem":
            # Inlined: code below whisk.db.max-inline-size lives in the name itself, base64url.
            encoded = name[4:]
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            except (binascii.Error, ValueError) as exc:
                raise ActionIncompatible(f"{doc_id}: bad inline attachment") from exc
        if scheme == "couch":
            attachment = name[len("couch:"):]
        elif scheme is None:
            attachment = name  # legacy relative names: "codefile", "jarfile"
        else:
            raise ActionFetchFailed(f"{doc_id}: attachment store {scheme!r} is not supported by this invoker")
        rev = doc.get("_rev")
        return await self._retry(
            lambda: self.client.get_attachment(self.db, doc_id, attachment, rev=rev if isinstance(rev, str) else None),
            f"{doc_id}/{attachment}",
        )


# --------------------------------------------------------------------------------------------
# Activation records (activations database)
# --------------------------------------------------------------------------------------------


class ActivationStore:
    def __init__(
        self,
        client: CouchClient,
        db: str,
        *,
        backoff: Backoff = _STORE_BACKOFF,
        deadline_s: float = 600.0,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.client = client
        self.db = db
        self.backoff = backoff
        self.deadline_s = deadline_s
        self.stop = stop
        self.stored = 0
        self.failed = 0

    async def store(self, activation: Activation) -> bool:
        """Write the record (logs included); True once it is in the database, by this call or earlier."""
        doc = activation_document(activation)
        doc_id = str(doc["_id"])
        try:
            await with_retries(lambda: self.client.put_doc(self.db, doc_id, doc), backoff=self.backoff,
                               deadline_s=self.deadline_s, stop=self.stop, what=doc_id)
        except DocumentConflict:
            # The same activation id was written before (a retried PUT whose answer was lost, or a
            # redelivered message): the record is there.
            pass
        except (CouchUnavailable, CouchRequestFailed) as exc:
            self.failed += 1
            log.error("activation.store_failed", doc_id=doc_id, error=str(exc))
            return False
        self.stored += 1
        return True

    async def exists(self, namespace: str, activation_id: str) -> bool:
        doc_id = activation_doc_id(namespace, activation_id)
        try:
            await with_retries(lambda: self.client.get_doc(self.db, doc_id), backoff=self.backoff,
                               deadline_s=self.deadline_s, stop=self.stop, what=doc_id)
        except DocumentNotFound:
            return False
        return True
