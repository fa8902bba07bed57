"""The whisks database's changes feed (`openwhisk/changes.py`) against a real CouchDB-API server
(pouchdb-server): what it hands out of the documents OpenWhisk's controller writes, from "now" on, and how it
comes back after the server went away — from its last sequence, nothing missed, nothing twice."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from ow_cluster.peers import PouchServer
from ow_cluster.support import WHISKS, put_action

from dilu_invoker.config import CouchConfig
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.openwhisk.changes import ActionChange, WhiskChanges
from dilu_invoker.openwhisk.couchdb import CouchClient

pytestmark = [pytest.mark.couchdb]

WEIGHTS = [{"key": "gpu-memory-mb", "value": 4000}, {"key": "gpu-weights-mb", "value": 3000}]


class Follower:
    """Runs ``feed.follow`` in the background and collects what it hands out."""

    def __init__(self, feed: WhiskChanges) -> None:
        self.feed = feed
        self.got: list[ActionChange] = []
        self.stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async for change in self.feed.follow(self.stop):
            self.got.append(change)

    async def __aenter__(self) -> Follower:
        self._task = asyncio.create_task(self._run())
        await self.until(lambda: self.feed.up)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.feed.close()

    async def until(self, check: Callable[[], bool], timeout_s: float = 8.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not check():
            assert loop.time() < deadline, f"timed out; got {self.got}"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def following(pouch: PouchServer, manifest: Manifest) -> AsyncIterator[Follower]:
    couch = CouchConfig(host="127.0.0.1", port=pouch.port, username=pouch.user, password=pouch.password)
    async with Follower(WhiskChanges(CouchClient(couch), WHISKS, manifest=manifest, heartbeat_s=0.5)) as f:
        yield f


async def test_it_hands_out_actions_written_from_now_on_and_their_deletion(
        pouch: PouchServer, ow_manifest: Manifest) -> None:
    await asyncio.to_thread(put_action, pouch, namespace="guest", name="before", kind="python:3-gpu",
                            annotations=WEIGHTS)
    async with following(pouch, ow_manifest) as f:
        rev = await asyncio.to_thread(put_action, pouch, namespace="guest", name="llm", kind="python:3-gpu",
                                      code="def main(a):\n    return a\n", annotations=WEIGHTS)
        await asyncio.to_thread(put_action, pouch, namespace="guest", name="cpu", kind="python:3.11")
        await asyncio.to_thread(put_action, pouch, namespace="guest", name="pkg", entity_type="package", code=None)
        status, _ = await asyncio.to_thread(pouch.json, "PUT", f"/{WHISKS}/_design%2Fwhisks", {"views": {}})
        assert status in (200, 201)
        status, doc = await asyncio.to_thread(pouch.json, "GET", f"/{WHISKS}/guest%2Fllm")
        status, _ = await asyncio.to_thread(pouch.json, "DELETE", f"/{WHISKS}/guest%2Fllm?rev={doc['_rev']}")
        assert status == 200
        await f.until(lambda: any(c.action is None for c in f.got))
        got = [(c.fqn, c.action is not None, c.gpu) for c in f.got]
        # each action's document, then its code attachment (two revisions), the deletion; no package, no
        # design document, nothing written before the feed started
        assert got == [("guest/llm", True, True), ("guest/llm", True, True), ("guest/cpu", True, False),
                       ("guest/cpu", True, False), ("guest/llm", False, False)], got
        llm = f.got[1]
        assert llm.rev == rev and llm.action is not None and llm.action.revision == rev
        assert llm.action.annotation("gpu-weights-mb") == 3000 and llm.action.exec.kind == "python:3-gpu"
        assert llm.action.exec.code is None  # the code is not fetched


async def test_it_resumes_from_its_last_sequence_after_couchdb_went_away(
        pouch: PouchServer, ow_manifest: Manifest) -> None:
    async with following(pouch, ow_manifest) as f:
        await asyncio.to_thread(put_action, pouch, namespace="guest", name="one", kind="python:3-gpu", code=None,
                                annotations=WEIGHTS)
        await f.until(lambda: len(f.got) == 1)
        await asyncio.to_thread(pouch.stop)
        await f.until(lambda: not f.feed.up and f.feed.stats.reconnects >= 2)
        await asyncio.to_thread(pouch.start)
        await asyncio.to_thread(put_action, pouch, namespace="guest", name="two", kind="python:3-gpu", code=None,
                                annotations=WEIGHTS)
        await f.until(lambda: len(f.got) == 2 and f.feed.up)
        assert [c.fqn for c in f.got] == ["guest/one", "guest/two"]  # nothing again, nothing missed
        assert f.feed.stats.connects >= 2 and "guest/two" in f.got[1].fqn
