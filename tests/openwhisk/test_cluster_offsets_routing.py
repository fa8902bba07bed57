"""Pure parts of the front: which offsets may be committed, GPU image matching, list settings."""

from __future__ import annotations

import itertools

import pytest
from aiokafka import TopicPartition

from dilu_invoker import config
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import Action, Exec
from dilu_invoker.openwhisk.backoff import Backoff
from dilu_invoker.openwhisk.invoker_main import front_options
from dilu_invoker.openwhisk.kafka import OffsetTracker
from dilu_invoker.openwhisk.routing import (
    GpuImages,
    balancer_split,
    blackbox_fractions,
    gpu_image_action,
    split_list,
)

TP = TopicPartition("invoker0", 0)


def test_commit_position_waits_for_the_oldest_record_in_work() -> None:
    tracker = OffsetTracker()
    for offset in (5, 6, 7):
        tracker.taken(TP, offset)
    assert tracker.committable() == {TP: 5}
    tracker.finished(TP, 6)
    tracker.finished(TP, 7)
    assert tracker.committable() == {TP: 5}  # 5 still in work: a crash must deliver it again
    tracker.finished(TP, 5)
    assert tracker.committable() == {TP: 8}
    tracker.committed({TP: 8})
    assert tracker.committable() == {}
    assert tracker.in_work() == 0


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))), ids=str)
def test_commit_position_never_passes_an_unfinished_record(order: tuple[int, ...]) -> None:
    tracker = OffsetTracker()
    for offset in range(4):
        tracker.taken(TP, offset)
    finished: set[int] = set()
    for offset in order:
        tracker.finished(TP, offset)
        finished.add(offset)
        expected = next(o for o in range(5) if o not in finished)
        assert tracker.committable().get(TP, 0) == expected


def test_a_revoked_partition_is_forgotten() -> None:
    tracker = OffsetTracker()
    tracker.taken(TP, 3)
    tracker.forget([TP])
    tracker.finished(TP, 3)  # the activation finishes after the rebalance: nothing to commit for it here
    assert tracker.committable() == {}


def test_backoff_grows_to_its_bound() -> None:
    delays = list(itertools.islice(Backoff(initial_s=0.1, maximum_s=1.0, jitter=0.0).delays(), 6))
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    with pytest.raises(ValueError):
        Backoff(initial_s=1.0, maximum_s=0.5)


@pytest.mark.parametrize(
    ("configured", "image", "matches"),
    [("myorg/gpu-python", "myorg/gpu-python:1.0", True),
     ("myorg/gpu-python", "myorg/gpu-python", True),
     ("myorg/gpu-python:1.0", "myorg/gpu-python:1.1", False),
     ("myorg/gpu-python:latest", "myorg/gpu-python", True),
     ("docker.io/myorg/gpu-python", "myorg/gpu-python:2", True),
     ("registry:5000/gpu", "registry:5000/gpu:3", True),
     ("myorg/gpu-python", "myorg/gpu-python-extra:1", False),
     ("python", "library/python:3.11", True)],
)
def test_gpu_image_matching(ow_manifest: Manifest, configured: str, image: str, matches: bool) -> None:
    assert GpuImages.parse(configured, manifest=ow_manifest).matches(image) is matches


def test_gpu_image_actions_become_the_gpu_kind(ow_manifest: Manifest) -> None:
    gpu = GpuImages.parse(" 'myorg/gpu-python' ", manifest=ow_manifest)
    assert gpu.gpu_kind == "python:3-gpu"
    docker = Action(namespace="guest", name="train", exec=Exec(kind="blackbox", image="myorg/gpu-python:1", code="c",
                                                              main="run"))
    mapped = gpu_image_action(docker, gpu)
    assert (mapped.exec.kind, mapped.exec.code, mapped.exec.main, mapped.exec.image) == ("python:3-gpu", "c", "run", None)
    no_code = Action(namespace="guest", name="x", exec=Exec(kind="blackbox", image="myorg/gpu-python:1"))
    assert gpu_image_action(no_code, gpu) is no_code
    other = Action(namespace="guest", name="y", exec=Exec(kind="blackbox", image="other/img", code="c"))
    assert gpu_image_action(other, gpu) is other


def test_gpu_images_need_a_gpu_kind() -> None:
    cpu_only = Manifest.from_json({"runtimes": {"python": [{"kind": "python:3.11", "image": {"name": "p"}}]}})
    with pytest.raises(ValueError, match="no GPU kind"):
        GpuImages.parse("myorg/gpu", manifest=cpu_only)
    assert GpuImages.parse("", manifest=cpu_only).images == ()


@pytest.mark.parametrize(("raw", "parts"), [("", ()), ("gpu", ("gpu",)), (" 'v1,gpu' ", ("v1", "gpu")),
                                            ("['gpu', 'v100']", ("gpu", "v100")), ("a,,b", ("a", "b"))])
def test_split_list(raw: str, parts: tuple[str, ...]) -> None:
    assert split_list(raw) == parts


def test_openwhisk_environment_names_reach_the_front(ow_manifest: Manifest) -> None:
    cfg = config.load(environ={
        "KAFKA_HOSTS": "kafka:9092", "CONFIG_whisk_couchdb_host": "couch", "CONFIG_whisk_containerPool_userMemory": "4096m",
        "CONFIG_whisk_kafka_topics_prefix": "ow_", "CONFIG_whisk_invoker_resource_tags": " 'gpu' ",
        "CONFIG_whisk_invoker_dedicated_namespaces": "", "CONFIG_whisk_userEvents_enabled": "true",
        "CONFIG_whisk_kafka_topics_userEvent_prefix": "ue_", "DILU_INVOKER_ID": "7",
    })
    options = front_options(cfg, ow_manifest)
    assert options.instance.to_json() == {"instance": 7, "userMemory": f"{4096 * 1024 * 1024} B",
                                          "instanceType": "invoker", "tags": ["gpu"], "dedicatedNamespaces": [],
                                          "uniqueName": "7"}
    assert options.max_peek == 32 and options.user_events
    assert options.topics.invoker(7).name == "ow_invoker7" and options.topics.completed("0").name == "ow_completed0"
    assert options.topics.health().name == "ow_health" and options.topics.events().name == "ue_events"


def test_missing_peers_are_configuration_errors(ow_manifest: Manifest) -> None:
    with pytest.raises(config.ConfigError, match="KAFKA_HOSTS"):
        front_options(config.load(environ={"CONFIG_whisk_couchdb_host": "c"}), ow_manifest)
    with pytest.raises(config.ConfigError, match="CONFIG_whisk_couchdb_host"):
        front_options(config.load(environ={"KAFKA_HOSTS": "k:9092"}), ow_manifest)


@pytest.mark.parametrize(("raw", "mb"), [("2048", 2048), ("2048m", 2048), ("2048 MB", 2048), ("2g", 2048),
                                         ("2147483648 B", 2048), ("512M", 512)])
def test_openwhisk_byte_sizes_for_user_memory(raw: str, mb: int) -> None:
    assert config.load(environ={"CONFIG_whisk_containerPool_userMemory": raw}).invoker.user_memory_mb == mb


def test_a_bad_byte_size_names_the_variable() -> None:
    with pytest.raises(config.ConfigError, match="CONFIG_whisk_containerPool_userMemory"):
        config.load(environ={"CONFIG_whisk_containerPool_userMemory": "lots"})


def test_epsilon_fractions_make_exactly_the_gpu_invokers_the_blackbox_set() -> None:
    wrong_naive = 0
    for n in range(2, 60):
        for k in range(1, n):
            managed, blackbox = blackbox_fractions(n, k)
            assert balancer_split(n, managed, blackbox) == (n - k, k), (n, k)
            # What ansible does with only a blackbox fraction: managedFraction = 1 - blackboxFraction.
            if balancer_split(n, 1 - k / n, k / n) != (n - k, k):
                wrong_naive += 1
    assert wrong_naive > 0  # the reason for the epsilon (reference/openwhisk.md §8.2)
    assert balancer_split(9, 1 - 3 / 9, 3 / 9) == (7, 3)  # one GPU invoker would also get managed work


def test_fractions_refuse_what_cannot_work() -> None:
    with pytest.raises(ValueError):
        blackbox_fractions(4, 4)
    with pytest.raises(ValueError):
        blackbox_fractions(2000, 1)
