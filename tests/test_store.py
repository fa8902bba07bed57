"""EntityStore against a real redis-server: revisions, the action cache, listing, retention."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from dilu_invoker.model import (
    Action,
    Activation,
    ActivationResponse,
    Exec,
    Parameter,
    annotations_of,
    new_activation_id,
)
from dilu_invoker.store import EntityStore, RevisionConflict


def action(name: str = "hello", *, ns: str = "guest", code: str = "def main(a): return a", updated: int = 1) -> Action:
    return Action(namespace=ns, name=name, exec=Exec(kind="python:3", code=code),
                  parameters=(Parameter("p", 1),), updated=updated)


def activation(name: str, start: int, *, ns: str = "guest", path: str | None = None) -> Activation:
    return Activation(
        namespace=ns, name=name, subject=ns, activation_id=new_activation_id(), start=start, end=start + 1,
        response=ActivationResponse.success({"start": start}), logs=("l1", "l2"),
        annotations=annotations_of([("path", path or f"{ns}/{name}")]),
    )


async def test_put_get_with_revisions(redis: aioredis.Redis) -> None:
    store = EntityStore(redis)
    created = await store.put_action(action(), expected_revision=None)
    assert created.revision is not None and created.revision.startswith("1-")
    got = await store.get_action("guest", "hello")
    assert got == created
    with pytest.raises(RevisionConflict):
        await store.put_action(action(), expected_revision=None)  # exists
    updated = await store.put_action(replace(created, version="0.0.2"), expected_revision=created.revision)
    assert updated.revision is not None and updated.revision.startswith("2-")
    with pytest.raises(RevisionConflict) as info:
        await store.put_action(created, expected_revision=created.revision)  # stale
    assert info.value.current == updated.revision
    with pytest.raises(RevisionConflict):
        await store.put_action(action("ghost"), expected_revision="1-abc")  # vanished / never existed
    assert (await store.get_action("guest", "hello")) == updated


async def test_cache_follows_writes_of_other_stores(redis: aioredis.Redis) -> None:
    reader, writer = EntityStore(redis), EntityStore(redis)
    first = await writer.put_action(action(code="v1"), expected_revision=None)
    assert (await reader.get_action("guest", "hello")) == first
    second = await writer.put_action(replace(first, exec=Exec(kind="python:3", code="v2")),
                                     expected_revision=first.revision)
    seen = await reader.get_action("guest", "hello")
    assert seen is not None and seen.exec.code == "v2" and seen.revision == second.revision
    await writer.delete_action("guest", "hello")
    assert await reader.get_action("guest", "hello") is None


async def test_a_cached_action_is_rechecked_only_after_the_recheck_period(redis: aioredis.Redis) -> None:
    reader, writer = EntityStore(redis, action_recheck_s=0.3), EntityStore(redis)
    first = await writer.put_action(action(code="v1"), expected_revision=None)
    assert (await reader.get_action("guest", "hello")) == first
    checks = reader.pipeliner.commands
    second = await writer.put_action(replace(first, exec=Exec(kind="python:3", code="v2")),
                                     expected_revision=first.revision)
    # Within the period the reader trusts its copy (no command sent) ...
    assert (await reader.get_action("guest", "hello")) == first and reader.pipeliner.commands == checks
    await asyncio.sleep(0.35)
    # ... after it, one revision check finds the other store's change.
    seen = await reader.get_action("guest", "hello")
    assert seen is not None and seen.revision == second.revision and reader.pipeliner.commands == checks + 1
    # Its own changes it sees at once; a delete by another store after the period.
    mine = await reader.put_action(replace(seen, exec=Exec(kind="python:3", code="v3")),
                                   expected_revision=second.revision)
    assert (await reader.get_action("guest", "hello")) == mine
    await writer.delete_action("guest", "hello")
    await asyncio.sleep(0.35)
    assert await reader.get_action("guest", "hello") is None
    await reader.put_action(action(code="v4"), expected_revision=None)
    await reader.delete_action("guest", "hello")
    assert await reader.get_action("guest", "hello") is None  # its own delete: at once


async def test_cached_reads_racing_a_delete_answer_without_error(redis: aioredis.Redis) -> None:
    """A cached read awaits Redis for the revision; a delete in the same store meanwhile drops the cache
    entry. The read must still answer (the action it saw, or None), never raise."""
    store = EntityStore(redis)
    for round_ in range(20):
        stored = await store.put_action(action(code=f"v{round_}"), expected_revision=None)
        assert await store.get_action("guest", "hello") == stored  # now cached
        results = await asyncio.gather(*(store.get_action("guest", "hello") for _ in range(8)),
                                       store.delete_action("guest", "hello"),
                                       *(store.get_action("guest", "hello") for _ in range(8)))
        assert all(r is None or r == stored for r in results[:8] + results[9:])
        assert results[8] == stored
        assert await store.get_action("guest", "hello") is None


async def test_delete_returns_the_action(redis: aioredis.Redis) -> None:
    store = EntityStore(redis)
    stored = await store.put_action(action(), expected_revision=None)
    assert await store.delete_action("guest", "hello") == stored
    assert await store.delete_action("guest", "hello") is None
    assert await store.list_actions("guest") == []
    assert await store.count_actions("guest") == 0


async def test_list_actions_newest_first_summaries(redis: aioredis.Redis) -> None:
    store = EntityStore(redis)
    for i, name in enumerate(["a", "b", "c"]):
        await store.put_action(action(name, updated=100 + i), expected_revision=None)
    await store.put_action(action("x", ns="other"), expected_revision=None)
    listed = await store.list_actions("guest")
    assert [a.name for a in listed] == ["c", "b", "a"]
    assert all(a.exec.code is None and a.parameters == () for a in listed)
    assert [a.name for a in await store.list_actions("guest", skip=1, limit=1)] == ["b"]
    assert await store.count_actions("guest") == 3 and await store.count_actions("guest", skip=2) == 1


async def test_prefixes_isolate_stores(redis: aioredis.Redis) -> None:
    one, two = EntityStore(redis, prefix="one:"), EntityStore(redis, prefix="two:")
    await one.put_action(action(), expected_revision=None)
    assert await two.get_action("guest", "hello") is None
    keys = [k.decode() if isinstance(k, bytes) else k for k in await redis.keys("*")]
    assert keys and all(k.startswith("one:") for k in keys)


async def test_activations_listing_and_filters(redis: aioredis.Redis) -> None:
    store = EntityStore(redis)
    recs = [activation("a", 10), activation("b", 20), activation("a", 30), activation("p", 40, path="guest/pkg/p")]
    for r in recs:
        await store.store_activation(r)
    listed = await store.list_activations("guest")
    assert [a.start for a in listed] == [40, 30, 20, 10]
    assert all(a.logs == () and a.response.result is None for a in listed)  # summaries
    full = await store.list_activations("guest", docs=True, limit=1)
    assert full == [recs[-1]]
    assert [a.start for a in await store.list_activations("guest", name="a")] == [30, 10]
    assert [a.start for a in await store.list_activations("guest", name="pkg/p")] == [40]
    assert [a.start for a in await store.list_activations("guest", since=20, upto=30)] == [30, 20]
    assert await store.count_activations("guest") == 4
    assert await store.count_activations("guest", name="a", since=11) == 1
    assert await store.get_activation("guest", recs[1].activation_id) == recs[1]
    assert await store.get_activation("other", recs[1].activation_id) is None


async def test_retention_trims_documents_and_indexes(redis: aioredis.Redis) -> None:
    store = EntityStore(redis, max_activations_per_namespace=3)
    recs = [activation("a" if i % 2 else "b", 100 + i) for i in range(7)]
    for r in recs:
        await store.store_activation(r)
    kept = recs[-3:]
    assert [a.activation_id for a in await store.list_activations("guest")] == [r.activation_id for r in reversed(kept)]
    for gone in recs[:4]:
        assert await store.get_activation("guest", gone.activation_id) is None
    by_name = {n: await store.list_activations("guest", name=n) for n in ("a", "b")}
    assert {a.activation_id for lst in by_name.values() for a in lst} == {r.activation_id for r in kept}
    assert await store.count_activations("guest", name="a") + await store.count_activations("guest", name="b") == 3
    doc_keys = await redis.keys("dilu:activation:guest/*")
    assert len(doc_keys) == 3


async def test_concurrent_creates_have_one_winner(redis: aioredis.Redis) -> None:
    stores = [EntityStore(redis) for _ in range(10)]
    results = await asyncio.gather(*(s.put_action(action(code=f"v{i}"), expected_revision=None)
                                     for i, s in enumerate(stores)), return_exceptions=True)
    winners = [r for r in results if isinstance(r, Action)]
    assert len(winners) == 1
    assert all(isinstance(r, RevisionConflict) for r in results if not isinstance(r, Action))


def test_max_activations_must_be_positive() -> None:
    with pytest.raises(ValueError):
        EntityStore(aioredis.Redis(), max_activations_per_namespace=0)


async def test_concurrent_records_share_pipelines_and_all_land(redis: aioredis.Redis) -> None:
    store = EntityStore(redis)
    recs = [activation("a", 1000 + i) for i in range(60)]
    await asyncio.gather(*(store.store_activation(r) for r in recs))
    # Every record is in Redis once store_activation returned, in far fewer round trips than records.
    assert store.pipeliner.commands == 60 and store.pipeliner.pipelines <= 3
    assert store.unstored == 0
    for r in recs:
        assert await store.get_activation("guest", r.activation_id) == r
    assert await store.count_activations("guest", name="a") == 60


async def test_concurrent_revision_checks_of_one_action_are_one_command(redis: aioredis.Redis) -> None:
    store = EntityStore(redis)
    stored = await store.put_action(action(), expected_revision=None)
    other = await store.put_action(action("other"), expected_revision=None)
    before = store.pipeliner.commands
    got = await asyncio.gather(*(store.get_action("guest", "hello") for _ in range(20)),
                               *(store.get_action("guest", "other") for _ in range(5)))
    assert got == [stored] * 20 + [other] * 5
    assert store.pipeliner.commands - before == 2


async def test_a_revision_check_after_an_update_by_another_store_sees_it(redis: aioredis.Redis) -> None:
    reader, writer = EntityStore(redis), EntityStore(redis)
    first = await writer.put_action(action(code="v1"), expected_revision=None)
    assert await reader.get_action("guest", "hello") == first  # cached
    for i in range(2, 12):
        in_flight = asyncio.ensure_future(reader.get_action("guest", "hello"))
        await asyncio.sleep(0)
        new = await writer.put_action(action(code=f"v{i}"), expected_revision=(await reader.get_action(
            "guest", "hello") or first).revision)
        assert (await in_flight) is not None
        # Asked after the update answered: never joined to a read that left before it.
        assert await reader.get_action("guest", "hello") == new


async def test_records_are_written_after_redis_lost_its_scripts(redis: aioredis.Redis) -> None:
    store = EntityStore(redis)
    first = activation("a", 1)
    await store.store_activation(first)
    await redis.script_flush()  # as after a restart of a Redis without persistence of scripts
    recs = [activation("a", 2 + i) for i in range(5)]
    await asyncio.gather(*(store.store_activation(r) for r in recs))  # in one pipeline
    await redis.script_flush()
    recs.append(activation("a", 10))
    await store.store_activation(recs[-1])  # alone: a plain command
    assert store.unstored == 0
    for r in [first, *recs]:
        assert await store.get_activation("guest", r.activation_id) == r
