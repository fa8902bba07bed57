"""Following the whisks database: every action OpenWhisk's controller creates, updates or deletes, as it
happens (CouchDB's ``_changes`` feed), for the balancer's model pre-loading (docs/balancer.md, "Model
pre-loading in cluster mode").

The controller writes an action as a document ``namespace[/package]/name`` of ``{prefix}whisks``
(``entityType: "action"``, ``exec.kind``, ``annotations``, ``limits``, ``_rev``; the code usually in an
attachment) and deletes it by revision; an invoker never sees the ``PUT``. :class:`WhiskChanges` reads
``_changes?feed=continuous&include_docs=true`` from the sequence the database was at when it started
("now": earlier changes are history, not news), with heartbeats so that a silent connection is noticed,
and yields one :class:`ActionChange` per changed action document (other entities, design documents and
unreadable documents are skipped; a deleted document is a change with no action). The code is not fetched:
what matters here is the kind and the annotations.

When CouchDB goes away (refused, reset, a 5xx, no heartbeat in ``2 × heartbeat``) it reconnects with
backoff and resumes from the last sequence it handed out, so nothing written meanwhile is missed and
nothing is handed out twice; the caller never sees the outage beyond :attr:`WhiskChanges.up`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from dilu_invoker.config import Config
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import Action, ValidationError
from dilu_invoker.openwhisk.backoff import Backoff, sleep_or_stop
from dilu_invoker.openwhisk.couchdb import CouchClient, CouchError
from dilu_invoker.openwhisk.routing import GpuImages, gpu_image_action

log = structlog.get_logger(__name__)

_RECONNECT = Backoff(initial_s=0.2, maximum_s=5.0)
#: CouchDB sends a newline this often while nothing changes
HEARTBEAT_S = 2.0


@dataclass(frozen=True, slots=True)
class ActionChange:
    """One action document as the feed saw it change."""

    #: ``namespace[/package]/name``: the document id, the action's fully qualified name
    fqn: str
    #: the document's new revision
    rev: str
    #: the action without its code; None once the document is deleted (or is no readable action any more)
    action: Action | None
    #: whether its kind is a GPU kind of the runtimes manifest (docker images: ``--invoker-gpu-images``)
    gpu: bool = False
    seq: Any = None


@dataclass(slots=True)
class FeedStats:
    connects: int = 0
    reconnects: int = 0
    changes: int = 0
    skipped: int = 0
    last_error: str = ""


def action_of(doc: Mapping[str, Any], *, manifest: Manifest, gpu_images: GpuImages) -> tuple[Action | None, bool]:
    """An action document as an :class:`Action` without its code, and whether it is of a GPU kind; (None,
    False) for another entity or a document that does not read as an action."""
    if doc.get("entityType", "action") != "action":
        return None, False
    exec_ = doc.get("exec")
    if not isinstance(exec_, Mapping) or not isinstance(exec_.get("kind"), str):
        return None, False
    exec_json: dict[str, Any] = {"kind": exec_["kind"].lower(), "binary": bool(exec_.get("binary", False))}
    for key in ("main", "image"):
        if isinstance(exec_.get(key), str):
            exec_json[key] = exec_[key]
    try:
        action = Action.from_json({**doc, "exec": exec_json})
    except (ValidationError, KeyError, TypeError, ValueError):
        return None, False
    action = gpu_image_action(action, gpu_images)
    runtime = manifest.resolve(action.exec.kind)
    return action, bool(runtime is not None and runtime.gpu)


class WhiskChanges:
    """The changes of one whisks database, from now on, for as long as it is iterated."""

    def __init__(self, client: CouchClient, db: str, *, manifest: Manifest, gpu_images: GpuImages | None = None,
                 heartbeat_s: float = HEARTBEAT_S, backoff: Backoff = _RECONNECT) -> None:
        self.client = client
        self.db = db
        self.manifest = manifest
        self.gpu_images = gpu_images or GpuImages()
        self.heartbeat_s = heartbeat_s
        self.backoff = backoff
        #: the last sequence handed out (where a reconnection resumes); None until the first connection
        self.seq: Any = None
        #: whether the feed is connected now
        self.up = False
        self.stats = FeedStats()

    @classmethod
    def from_config(cls, cfg: Config, *, heartbeat_s: float = HEARTBEAT_S) -> WhiskChanges:
        manifest = Manifest.load(cfg.invoker.runtimes_manifest)
        gpu_images = GpuImages.parse(cfg.invoker.gpu_images, manifest=manifest)
        client = CouchClient(cfg.couchdb)  # the feed's own request has no total timeout (see _stream)
        return cls(client, cfg.whisks_db, manifest=manifest, gpu_images=gpu_images, heartbeat_s=heartbeat_s)

    async def close(self) -> None:
        await self.client.close()

    async def follow(self, stop: asyncio.Event | None = None) -> AsyncIterator[ActionChange]:
        """The changes until ``stop`` is set (or the iteration is closed); never raises for CouchDB's faults."""
        stop = stop or asyncio.Event()
        delays = self.backoff.delays()
        while not stop.is_set():
            try:
                if self.seq is None:
                    self.seq = await self._now()
                async for change in self._stream(stop):
                    delays = self.backoff.delays()  # it answered: the next outage starts from a short wait
                    yield change
            except (CouchError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self._down(exc)
            if stop.is_set():
                break
            self.stats.reconnects += 1
            if await sleep_or_stop(next(delays), stop):
                break
        self.up = False

    def _down(self, exc: BaseException) -> None:
        error = repr(exc)
        if self.up or error != self.stats.last_error:
            log.warning("couchdb changes feed lost; reconnecting", db=self.db, since=self.seq, error=error)
        self.up = False
        self.stats.last_error = error

    async def _now(self) -> Any:
        """The database's sequence now (``GET /{db}``'s ``update_seq``): the feed starts after it."""
        status, content = await self.client.request("GET", self.db)
        if status != 200:
            raise CouchError(f"GET /{self.db}: HTTP {status} {content[:200]!r}")
        info = json.loads(content)
        return info.get("update_seq", 0)

    async def _stream(self, stop: asyncio.Event) -> AsyncIterator[ActionChange]:
        params = {"feed": "continuous", "include_docs": "true", "since": _seq_param(self.seq),
                  "heartbeat": str(int(self.heartbeat_s * 1000))}
        session = self.client._session_()
        url = self.client.url(self.db, "_changes", params=params)
        # One long response: no total timeout; a silence longer than two heartbeats means CouchDB is gone.
        timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=2 * self.heartbeat_s)
        # Uncompressed: a compressing server (pouchdb-server's express) would hold each change in its buffer.
        async with session.get(url, timeout=timeout, headers={"Accept-Encoding": "identity"}) as resp:
            if resp.status != 200:
                body = await resp.read()
                raise CouchError(f"GET /{self.db}/_changes: HTTP {resp.status} {body[:200]!r}")
            self.client.available = True
            self.stats.connects += 1
            if not self.up:
                log.info("couchdb changes feed connected", db=self.db, since=self.seq,
                         reconnect=self.stats.connects > 1)
            self.up = True
            while not stop.is_set():
                line = await resp.content.readline()
                if not line:
                    raise CouchError("the changes feed ended")
                line = line.strip()
                if not line:
                    continue  # a heartbeat
                row = json.loads(line)
                if not isinstance(row, dict):
                    self.stats.skipped += 1
                    log.warning("unreadable row in the changes feed; skipped", row=line[:200])
                    continue
                if "last_seq" in row and "id" not in row:
                    raise CouchError("the changes feed ended")
                try:
                    change = self._change(row)
                except (TypeError, AttributeError, IndexError, KeyError) as exc:  # a row of an odd shape
                    self.stats.skipped += 1
                    log.warning("unreadable row in the changes feed; skipped", id=row.get("id"), error=repr(exc))
                    change = None
                self.seq = row.get("seq", self.seq)
                if change is not None:
                    self.stats.changes += 1
                    yield change

    def _change(self, row: Mapping[str, Any]) -> ActionChange | None:
        doc_id = row.get("id")
        if not isinstance(doc_id, str) or doc_id.startswith("_design/"):
            return None
        changes = row.get("changes") or [{}]
        rev = str(changes[0].get("rev", "")) if isinstance(changes[0], Mapping) else ""
        doc = row.get("doc")
        if row.get("deleted") or not isinstance(doc, Mapping) or doc.get("_deleted"):
            return ActionChange(fqn=doc_id, rev=rev, action=None, seq=row.get("seq"))
        action, gpu = action_of(doc, manifest=self.manifest, gpu_images=self.gpu_images)
        if action is None:
            if doc.get("entityType", "action") == "action":
                self.stats.skipped += 1
                log.info("unreadable action document in the changes feed", id=doc_id, rev=rev)
                return ActionChange(fqn=doc_id, rev=rev, action=None, seq=row.get("seq"))
            return None  # a package, trigger, rule…
        return ActionChange(fqn=doc_id, rev=rev, action=action, gpu=gpu, seq=row.get("seq"))


def _seq_param(seq: Any) -> str:
    return seq if isinstance(seq, str) else json.dumps(seq)
