"""Action documents and activation records against a real CouchDB-API server (pouchdb-server)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from ow_cluster.peers import PouchServer, free_port
from ow_cluster.support import ACTIVATIONS, WHISKS, put_action

from dilu_invoker import config
from dilu_invoker.config import CouchConfig
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import ActivationResponse, ActivationStatus
from dilu_invoker.openwhisk.backoff import Backoff
from dilu_invoker.openwhisk.couchdb import (
    ActionFetchFailed,
    ActionIncompatible,
    ActionNotFound,
    ActionStore,
    ActivationStore,
    CouchClient,
    CouchUnavailable,
)
from dilu_invoker.openwhisk.messages import fallback_activation

pytestmark = pytest.mark.couchdb

FAST = Backoff(initial_s=0.01, maximum_s=0.05)


def couch_config(pouch: PouchServer, *, password: str | None = None, port: int | None = None) -> CouchConfig:
    return CouchConfig(host="127.0.0.1", port=port or pouch.port, username=pouch.user,
                       password=password or pouch.password)


@pytest_asyncio.fixture
async def client(pouch: PouchServer) -> AsyncIterator[CouchClient]:
    async with CouchClient(couch_config(pouch)) as c:
        yield c


@pytest.fixture
def store(client: CouchClient, ow_manifest: Manifest) -> ActionStore:
    return ActionStore(client, WHISKS, manifest=ow_manifest, backoff=FAST, deadline_s=1.0)


TEXT = "def main(args):\n    return {'héllo': args}\n"
ZIP = b"PK\x03\x04" + bytes(range(256))


@pytest.mark.parametrize("form", ["inline", "mem", "couch", "legacy"])
async def test_text_code_in_every_stored_form(pouch: PouchServer, store: ActionStore, form: str) -> None:
    rev = put_action(pouch, namespace="guest", name=f"text-{form}", code=TEXT, store=form)
    action = await store.get("guest", f"text-{form}", rev)
    assert action.exec.code == TEXT and action.exec.binary is False
    assert action.exec.kind == "python:3.11" and action.revision == rev
    assert action.fqn == f"guest/text-{form}"


@pytest.mark.parametrize("form", ["inline", "mem", "couch"])
async def test_binary_code_is_base64_for_init(pouch: PouchServer, store: ActionStore, form: str) -> None:
    rev = put_action(pouch, namespace="guest", name=f"zip-{form}", code=ZIP, binary=True, store=form)
    action = await store.get("guest", f"zip-{form}", rev)
    assert action.exec.binary is True
    assert base64.b64decode(action.exec.code or "") == ZIP


async def test_package_actions_and_revision_cache(pouch: PouchServer, store: ActionStore) -> None:
    rev = put_action(pouch, namespace="guest/utils", name="echo", code="x")
    first = await store.get("guest/utils", "echo", rev)
    fetches = store.fetches
    assert await store.get("guest/utils", "echo", rev) is first
    assert store.fetches == fetches
    assert first.fqn == "guest/utils/echo"


async def test_stale_revision_reads_the_latest(pouch: PouchServer, store: ActionStore) -> None:
    old = put_action(pouch, namespace="guest", name="moving", code="v1")
    new = put_action(pouch, namespace="guest", name="moving", code="v2", store="inline")
    assert old != new
    action = await store.get("guest", "moving", "9-0000000000000000000000000000000a")
    assert action.exec.code == "v2" and action.revision == new
    assert (await store.get("guest", "moving", None)).exec.code == "v2"


async def test_tolerates_fields_it_does_not_know(pouch: PouchServer, client: CouchClient, store: ActionStore) -> None:
    doc = {
        "entityType": "action", "namespace": "guest", "name": "extras", "version": "0.0.3", "publish": False,
        "exec": {"kind": "nodejs:20", "code": "function main(){}", "binary": False, "futureField": 1},
        "parameters": [{"key": "KEY", "value": "v", "init": True}, {"key": "secret", "value": "xx", "encryption": "aes-256"}],
        "limits": {"timeout": 1000, "memory": 128, "logs": 0, "concurrency": 3, "instances": 2},
        "annotations": [{"key": "provide-api-key", "value": False}], "updated": 1, "somethingElse": {"a": 1},
    }
    rev = await client.put_doc(WHISKS, "guest/extras", doc)
    action = await store.get("guest", "extras", rev)
    assert action.limits.logs_mb == 0 and action.limits.concurrency == 3
    assert action.init_param_names == ("KEY",) and not action.provide_api_key()
    assert action.version == "0.0.3"


async def test_missing_document_is_not_found(store: ActionStore) -> None:
    with pytest.raises(ActionNotFound) as err:
        await store.get("guest", "nope", "1-abc")
    assert err.value.response.status is ActivationStatus.APPLICATION_ERROR


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"kind": "swift:5.7"}, ActionIncompatible), ({"kind": "sequence", "code": None}, ActionIncompatible),
     ({"entity_type": "trigger"}, ActionIncompatible)],
    ids=["unknown-kind", "sequence", "not-an-action"],
)
async def test_unusable_documents_are_incompatible(pouch: PouchServer, store: ActionStore, kwargs: dict[str, object],
                                                   error: type[Exception]) -> None:
    name = f"bad-{abs(hash(json.dumps(kwargs, sort_keys=True)))}"
    rev = put_action(pouch, namespace="guest", name=name, **{"code": "x", **kwargs})  # type: ignore[arg-type]
    with pytest.raises(error) as err:
        await store.get("guest", name, rev)
    assert err.value.response.status is ActivationStatus.WHISK_ERROR  # type: ignore[attr-defined]


async def test_default_kind_of_a_family_is_known(pouch: PouchServer, store: ActionStore) -> None:
    rev = put_action(pouch, namespace="guest", name="defaulted", kind="nodejs:default", code="x")
    assert (await store.get("guest", "defaulted", rev)).exec.kind == "nodejs:default"


async def test_external_attachment_stores_cannot_be_fetched(client: CouchClient, store: ActionStore) -> None:
    rev = await client.put_doc(WHISKS, "guest/in-s3", {
        "entityType": "action", "namespace": "guest", "name": "in-s3",
        "exec": {"kind": "python:3.11", "binary": False,
                 "code": {"attachmentName": "s3:abc-123", "attachmentType": "text/plain"}}})
    with pytest.raises(ActionFetchFailed, match="s3"):
        await store.get("guest", "in-s3", rev)


async def test_wrong_credentials_are_a_fetch_error_and_stop_pings(pouch: PouchServer, ow_manifest: Manifest) -> None:
    rev = put_action(pouch, namespace="guest", name="guarded", code="x")
    async with CouchClient(couch_config(pouch, password="wrong")) as bad:
        store = ActionStore(bad, WHISKS, manifest=ow_manifest, backoff=FAST, deadline_s=1.0)
        with pytest.raises(ActionFetchFailed, match="401"):
            await store.get("guest", "guarded", rev)
        reason = await bad.probe(WHISKS)
        assert reason is not None and "401" in reason
        assert bad.available is False


async def test_unreachable_database_gives_up_at_the_deadline(pouch: PouchServer, ow_manifest: Manifest) -> None:
    async with CouchClient(couch_config(pouch, port=free_port()), timeout_s=1.0) as down:
        store = ActionStore(down, WHISKS, manifest=ow_manifest, backoff=FAST, deadline_s=0.3)
        with pytest.raises(ActionFetchFailed) as err:
            await store.get("guest", "anything", "1-a")
        assert err.value.response.status is ActivationStatus.WHISK_ERROR
        assert down.available is False
        assert await down.probe(WHISKS) is not None
        with pytest.raises(CouchUnavailable):
            await down.get_doc(WHISKS, "x")


async def test_activation_records_are_written_once(pouch: PouchServer, client: CouchClient) -> None:
    store = ActivationStore(client, ACTIVATIONS, backoff=FAST, deadline_s=1.0)
    record = fallback_activation(activation_id="ab" * 16, namespace="guest", subject="guest", action_path="guest",
                                 action_name="stored", response=ActivationResponse.success({"n": 1}))
    assert not await store.exists("guest", record.activation_id)
    assert await store.store(record)
    assert await store.store(record)  # a redelivery or a retried PUT: 409 means it is there
    assert await store.exists("guest", record.activation_id)
    status, doc = pouch.json("GET", f"/{ACTIVATIONS}/guest%2F{record.activation_id}")
    assert status == 200 and str(doc["_rev"]).startswith("1-")
    assert doc["activationId"] == record.activation_id and doc["response"] == {"statusCode": 0, "result": {"n": 1}}
    assert store.stored == 2 and store.failed == 0


async def test_unreachable_store_reports_failure(pouch: PouchServer) -> None:
    async with CouchClient(couch_config(pouch, port=free_port()), timeout_s=1.0) as down:
        store = ActivationStore(down, ACTIVATIONS, backoff=FAST, deadline_s=0.2)
        record = fallback_activation(activation_id="cd" * 16, namespace="guest", subject="guest",
                                     action_path="guest", action_name="x", response=ActivationResponse.success({}))
        assert await store.store(record) is False
        assert store.failed == 1


def test_database_names_follow_openwhisk_settings() -> None:
    cfg = config.load(environ={"DILU_COUCHDB_DB_PREFIX": "prod_"})
    assert (cfg.whisks_db, cfg.activations_db) == ("prod_whisks", "prod_activations")
    cfg = config.load(environ={"DB_WHISK_ACTIONS": "a", "CONFIG_whisk_couchdb_databases_WhiskActivation": "b"})
    assert (cfg.whisks_db, cfg.activations_db) == ("a", "b")
