"""Helpers of the OpenWhisk cluster-mode tests: the manifest a deployment shares, the environment its
invokers get, actions stored the way OpenWhisk's controller stores them, and an invoker front running
against the test's broker and database."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ow_cluster.peers import PouchServer, TansuBroker

from dilu_invoker import config
from dilu_invoker.config import Config
from dilu_invoker.invoker.manifest import Manifest

if TYPE_CHECKING:
    from ow_cluster.doubles import ScriptedRunner

    from dilu_invoker.openwhisk.cluster import ClusterFront

DB_PREFIX = "whisk_test_"
WHISKS = f"{DB_PREFIX}whisks"
ACTIVATIONS = f"{DB_PREFIX}activations"

#: A manifest in OpenWhisk's format with the GPU kind, shared by controller and invokers in a deployment.
MANIFEST_JSON: dict[str, Any] = {
    "runtimes": {
        "nodejs": [
            {"kind": "nodejs:20", "default": True,
             "image": {"prefix": "openwhisk", "name": "action-nodejs-v20", "tag": "nightly"},
             "attached": {"attachmentName": "codefile", "attachmentType": "text/plain"}},
        ],
        "python": [
            {"kind": "python:3.11", "default": True,
             "image": {"prefix": "openwhisk", "name": "action-python-v3.11", "tag": "nightly"},
             "attached": {"attachmentName": "codefile", "attachmentType": "text/plain"}},
            {"kind": "python:3-gpu", "default": False,
             "image": {"prefix": "dilu", "name": "action-python-gpu", "tag": "latest"},
             "attached": {"attachmentName": "codefile", "attachmentType": "text/plain"}},
        ],
    },
    "blackboxes": [{"prefix": "openwhisk", "name": "dockerskeleton", "tag": "nightly"}],
}


def invoker_env(broker: TansuBroker, pouch: PouchServer, **extra: str) -> dict[str, str]:
    """The environment an OpenWhisk deployment gives its invokers (the names ansible renders)."""
    env = {
        "KAFKA_HOSTS": broker.bootstrap,
        "CONFIG_whisk_couchdb_protocol": "http",
        "CONFIG_whisk_couchdb_host": "127.0.0.1",
        "CONFIG_whisk_couchdb_port": str(pouch.port),
        "CONFIG_whisk_couchdb_username": pouch.user,
        "CONFIG_whisk_couchdb_password": pouch.password,
        "CONFIG_whisk_couchdb_databases_WhiskEntity": WHISKS,
        "CONFIG_whisk_couchdb_databases_WhiskActivation": ACTIVATIONS,
        "CONFIG_whisk_containerPool_userMemory": "1024m",
        "RUNTIMES_MANIFEST": json.dumps(MANIFEST_JSON),
        "DILU_LOG_LEVEL": "info",
    }
    env.update(extra)
    return env


def invoker_config(broker: TansuBroker, pouch: PouchServer, *, invoker_id: int, **extra: str) -> Config:
    return config.load(environ={**invoker_env(broker, pouch, **extra), "DILU_INVOKER_ID": str(invoker_id)})


@asynccontextmanager
async def running_front(broker: TansuBroker, pouch: PouchServer, manifest: Manifest, *, invoker_id: int,
                        runner: ScriptedRunner, env: Mapping[str, str] | None = None,
                        **front: Any) -> AsyncIterator[ClusterFront]:
    """An invoker's front (``build_front``) over ``runner``, once its group has assigned it its topic;
    ``env``: more of the deployment's environment, ``front``: more of ``build_front``'s arguments."""
    from dilu_invoker.openwhisk.invoker_main import build_front  # the REST tests sharing the conftest skip it

    cfg = invoker_config(broker, pouch, invoker_id=invoker_id, **(env or {}))
    async with build_front(cfg, runner=runner, manifest=manifest, **front) as started:
        await asyncio.wait_for(started.assigned.wait(), 30)
        yield started


def metric_sum(port: int, name: str, **labels: str) -> float:
    """The sum of a metric's samples on the /metrics of the invoker at ``port`` whose labels start with
    ``labels`` (every sample of the metric when none are given)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefixes = (name + "{" + want,) if want else (name + "{", name + " ")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefixes))


async def stop_processes(procs: Iterable[subprocess.Popen[bytes]], *, wait_s: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for each (killed after ``wait_s``)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            await asyncio.to_thread(p.wait, wait_s)
        except subprocess.TimeoutExpired:
            p.kill()


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def put_action(
    pouch: PouchServer,
    *,
    namespace: str,
    name: str,
    kind: str = "python:3.11",
    code: str | bytes | None = "",
    store: str = "couch",
    binary: bool = False,
    limits: Mapping[str, int] | None = None,
    image: str | None = None,
    annotations: list[dict[str, Any]] | None = None,
    entity_type: str = "action",
    db: str = WHISKS,
) -> str:
    """Store an action as the controller does (``WhiskAction.put``); returns its revision.

    ``store``: ``couch`` (attachment ``couch:<uuid>``), ``mem`` (inlined in the attachment name),
    ``legacy`` (attachment ``codefile``) or ``inline`` (code string in the document).
    """
    doc_id = f"{namespace}/{name}"
    quoted = doc_id.replace("/", "%2F")
    raw = code.encode() if isinstance(code, str) else code
    exec_: dict[str, Any] = {"kind": kind, "binary": binary}
    if image is not None:
        exec_["image"] = image
    content_type = "application/octet-stream" if binary else "text/plain; charset=UTF-8"
    attachment: str | None = None
    if raw is not None:
        if store == "inline":
            exec_["code"] = base64.b64encode(raw).decode() if binary else raw.decode()
        elif store == "mem":
            exec_["code"] = {"attachmentName": "mem:" + base64.urlsafe_b64encode(raw).decode().rstrip("="),
                             "attachmentType": content_type}
        elif store == "couch":
            attachment = str(uuid.uuid4())
            exec_["code"] = {"attachmentName": f"couch:{attachment}", "attachmentType": content_type,
                             "length": len(raw)}
        elif store == "legacy":
            attachment = "codefile"
            exec_["code"] = {"attachmentName": attachment, "attachmentType": content_type}
        else:
            raise ValueError(store)
    doc = {
        "entityType": entity_type,
        "namespace": namespace,
        "name": name,
        "exec": exec_,
        "parameters": [],
        "limits": dict(limits or {"timeout": 60000, "memory": 256, "logs": 10, "concurrency": 1}),
        "version": "0.0.1",
        "publish": False,
        "annotations": annotations if annotations is not None else [{"key": "exec", "value": kind}],
        "updated": 1700000000000,
    }
    status, existing = pouch.json("GET", f"/{db}/{quoted}")
    if status == 200:
        doc["_rev"] = existing["_rev"]
    status, body = pouch.json("PUT", f"/{db}/{quoted}", doc)
    assert status in (200, 201), body
    rev = str(body["rev"])
    if attachment is not None:
        assert raw is not None
        status, content = pouch.request("PUT", f"/{db}/{quoted}/{attachment}?rev={rev}", raw=raw,
                                        content_type=content_type)
        assert status in (200, 201), content
        rev = json.loads(content)["rev"]
    return rev


def get_activation(pouch: PouchServer, namespace: str, activation_id: str) -> dict[str, Any] | None:
    status, body = pouch.json("GET", f"/{ACTIVATIONS}/{namespace}%2F{activation_id}")
    return body if status == 200 else None

