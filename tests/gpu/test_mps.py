"""MPS daemons run by the node, against a fake ``nvidia-cuda-mps-control`` (tests/gpu/fakes): the mode each
GPU runs in and why, start / adopt / supervise / stop, and what GPU containers are given."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dilu_invoker.config import ConfigError, GpuConfig
from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.gpu.mps import (
    CONTAINER_PIPE_DIR,
    MpsDecision,
    MpsError,
    MpsMetrics,
    MpsMode,
    MpsSupervisor,
    active_thread_percentage,
    decide_mps,
)
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.model import GpuClass, GpuNeeds

FAKE = str(Path(__file__).resolve().parent / "fakes" / "nvidia-cuda-mps-control")
GPU = GpuDevice(index=0, uuid="GPU-mps-0", name="inventory GPU", memory_mb=80_000, sm_count=132, simulated=True)
NEEDS = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.4, sm_limit=0.7, memory_mb=1000)


@pytest.mark.parametrize(
    ("mode", "control", "compute_mode", "enabled", "why"),
    [
        (MpsMode.OFF, "/bin/x", 0, False, "--gpu-mps off"),
        (MpsMode.AUTO, None, 0, False, "not found: time-slicing"),
        (MpsMode.AUTO, "/bin/x", 2, False, "compute mode Prohibited does not allow MPS"),
        (MpsMode.AUTO, "/bin/x", None, False, "compute mode is unknown"),
        (MpsMode.AUTO, "/bin/x", 0, True, "found, compute mode Default"),
        (MpsMode.AUTO, "/bin/x", 3, True, "compute mode Exclusive_Process"),
        (MpsMode.ON, "/bin/x", None, True, "--gpu-mps on"),
        (MpsMode.ON, "/bin/x", 2, True, "although the compute mode is Prohibited"),
        (MpsMode.ON, None, 0, True, "not found"),
    ],
    ids=["off", "auto-no-binary", "auto-prohibited", "auto-unknown-mode", "auto-default", "auto-exclusive-process",
         "on-unknown-mode", "on-prohibited", "on-no-binary"],
)
def test_decide_mps(mode: MpsMode, control: str | None, compute_mode: int | None, enabled: bool, why: str) -> None:
    d = decide_mps(mode, control=control, compute_mode=compute_mode)
    assert d.enabled is enabled
    assert why in d.reason


def test_separate_uids_keep_mps_off() -> None:
    """An MPS daemon serves one uid at a time: isolated containers (a uid each) must not be MPS clients."""
    why = "process isolation runs every container as its own uid"
    d = decide_mps(MpsMode.AUTO, control="/bin/x", compute_mode=0, separate_uids=why)
    assert d.enabled is False
    assert why in d.reason and "one uid at a time" in d.reason and d.reason.endswith("time-slicing")
    with pytest.raises(MpsError, match="--invoker-process-isolation off"):
        decide_mps(MpsMode.ON, control="/bin/x", compute_mode=0, separate_uids=why)
    assert decide_mps(MpsMode.OFF, control="/bin/x", compute_mode=0, separate_uids=why).enabled is False


async def test_supervisor_with_separate_uids_starts_no_daemon(tmp_path: Path) -> None:
    sup = MpsSupervisor(mode=MpsMode.AUTO, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        compute_mode=lambda _i: 0, check_every_s=3600, separate_uids="a uid per container")
    await sup.start()
    try:
        assert not sup.daemons and not sup.enabled(0)
        assert "a uid per container" in sup.decisions[0].reason
        assert not (tmp_path / "mps" / "gpu0").exists()
    finally:
        await sup.stop()


@pytest.mark.parametrize(("limit", "pct"), [(1.0, 100), (0.5, 50), (0.704, 70), (0.001, 1), (1.5, 100)])
def test_active_thread_percentage_follows_the_limit(limit: float, pct: int) -> None:
    assert active_thread_percentage(limit) == pct


def test_mode_flag_is_validated() -> None:
    assert MpsMode.parse(" ON ") is MpsMode.ON
    with pytest.raises(ValueError, match="auto, on or off"):
        MpsMode.parse("sometimes")
    with pytest.raises(ConfigError, match="--gpu-mps"):
        GpuConfig(mps="always")


def _log(root: Path) -> list[str]:
    return (root / "gpu0" / "log" / "control.log").read_text().splitlines()


def _pid(root: Path) -> int:
    return int((root / "gpu0" / "pipe" / "fake-daemon.pid").read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the fake's daemon is double-forked: init reaps it, no zombie answers here
    except OSError:
        return False
    return True


async def test_start_adopt_supervise_stop(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    root = tmp_path / "mps"
    sup = MpsSupervisor(mode=MpsMode.ON, root=root, gpus=((0, "GPU-mps-0"),), control=FAKE,
                        metrics=MpsMetrics(registry), check_every_s=3600)
    await sup.start()
    try:
        assert sup.enabled(0) and sup.daemons[0].started
        assert "started" in sup.decisions[0].reason
        for d in (root / "gpu0", root / "gpu0" / "pipe", root / "gpu0" / "log"):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        assert _log(root) == [f"start pid={_pid(root)} CUDA_VISIBLE_DEVICES=GPU-mps-0"]
        labels = {"gpu": "0", "uuid": "GPU-mps-0", "reason": sup.decisions[0].reason}
        assert registry.get_sample_value("dilu_gpu_mps_enabled", labels) == 1

        # Another supervisor on the same directories (an invoker restarted) adopts the running daemon and
        # leaves it running when it stops.
        other = MpsSupervisor(mode=MpsMode.ON, root=root, gpus=((0, "GPU-mps-0"),), control=FAKE, check_every_s=3600)
        await other.start()
        assert other.daemons[0].adopted and not other.daemons[0].started
        assert "adopted" in other.decisions[0].reason
        await other.stop()
        first = _pid(root)
        assert _alive(first)

        # The daemon dies: the supervisor starts it again and counts it.
        os.kill(first, signal.SIGKILL)
        for _ in range(100):
            if not await sup.daemons[0].alive():
                break
        await sup.check_once()
        second = _pid(root)
        assert second != first and await sup.daemons[0].alive()
        assert sup.daemons[0].restarts == 1
        assert registry.get_sample_value("dilu_gpu_mps_restarts_total", {"gpu": "0", "uuid": "GPU-mps-0"}) == 1
        await sup.check_once()  # alive: nothing to do
        assert sup.daemons[0].restarts == 1
    finally:
        await sup.stop()
    assert _log(root)[-1] == f"quit pid={second}"
    assert not await sup.daemons[0].alive()


async def test_auto_falls_back_to_time_slicing_and_on_fails_loudly(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    missing = MpsSupervisor(mode=MpsMode.AUTO, root=tmp_path / "a", gpus=((0, "G"),), control="no-such-mps-control")
    await missing.start()
    assert not missing.enabled(0) and "not found" in missing.decisions[0].reason
    unknown = MpsSupervisor(mode=MpsMode.AUTO, root=tmp_path / "b", gpus=((0, "G"),), control=FAKE)
    await unknown.start()  # no NVML here: the compute mode is unknown, auto does not guess
    assert not unknown.enabled(0) and "unknown" in unknown.decisions[0].reason
    assert unknown.client(0, 0.5, backend="process") is None

    monkeypatch.setenv("FAKE_MPS_FAIL_START", "1")
    broken = MpsSupervisor(mode=MpsMode.AUTO, root=tmp_path / "c", gpus=((0, "G"),), control=FAKE,
                           compute_mode=lambda _i: 0)
    await broken.start()
    assert broken.decisions[0] == MpsDecision(False, broken.decisions[0].reason)
    assert "did not start" in broken.decisions[0].reason and "refusing" in broken.decisions[0].reason
    with pytest.raises(MpsError, match="refusing"):
        await MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "d", gpus=((0, "G"),), control=FAKE).start()
    with pytest.raises(MpsError, match="not found"):
        await MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "e", gpus=((0, "G"),), control="no-such").start()


@pytest.mark.parametrize("backend", ["process", "docker"])
async def test_gpu_containers_are_mps_clients_capped_by_their_limit(tmp_path: Path, backend: str) -> None:
    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        check_every_s=3600)
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", backend=backend,
                   docker_gpu_mode="devices", mps=sup)
    await node.start()
    try:
        a = await node.attach("i1", "guest/classify", NEEDS)
        assert a is not None
        assert a.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
        pipe = tmp_path / "mps" / "gpu0" / "pipe"
        if backend == "process":
            assert a.env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
            assert a.env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "mps" / "gpu0" / "log")
        else:
            assert a.env["CUDA_MPS_PIPE_DIRECTORY"] == CONTAINER_PIPE_DIR
            mounts = {(m.source, m.target, m.read_only) for m in a.mounts}
            assert (str(pipe), CONTAINER_PIPE_DIR, False) in mounts
            from dilu_invoker.invoker.dataplane.backends.base import ContainerSpec
            from dilu_invoker.invoker.dataplane.backends.docker import DockerBackend

            spec = ContainerSpec(name="c", kind="python:3-gpu", image="img", memory_mb=256, env=a.env)
            backend_obj = DockerBackend(url="unix:///nonexistent.sock", gpu_mode="devices")  # connects lazily
            assert backend_obj._create_kwargs(spec)["ipc_mode"] == "host"
    finally:
        await node.close()
    assert not await sup.daemons[0].alive(), "the node stops the daemon it started"


@pytest.mark.parametrize(("policy", "train_pct", "infer_pct"), [("slo", "60", "80"), ("spatial", "50", "80"),
                                                                  ("static", "70", "80")])
async def test_the_policy_chooses_each_clients_active_threads_at_start(tmp_path: Path, policy: str, train_pct: str,
                                                                       infer_pct: str) -> None:
    """`ShareDecision.mps_threads` applied where MPS can take it, at the container's start: under `slo` a
    best-effort client starts at `mps_best_effort_threads` (0.6 here, below its limit 0.7); a latency-critical
    one, and every client under `static`, at its SM limit; under `spatial` a best-effort client at 1 − the
    latency-critical reserve 0.5. Under every policy a best-effort client connects at below-normal priority."""
    from dilu_invoker.policy.vertical_slo import SloConfig, SpatialConfig, StaticConfig

    vertical = {"slo": SloConfig(mps_best_effort_threads=0.6), "spatial": SpatialConfig(),
                "static": StaticConfig()}[policy]
    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        check_every_s=3600)
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", backend="process", mps=sup,
                   vertical=vertical)
    train = GpuNeeds(gpu_class=GpuClass.TRAINING, sm_request=0.2, sm_limit=0.7, memory_mb=1000)
    infer = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.3, sm_limit=0.8, memory_mb=1000)
    small = GpuNeeds(gpu_class=GpuClass.TRAINING, sm_request=0.1, sm_limit=0.3, memory_mb=1000)
    await node.start()
    try:
        t = await node.attach("t1", "guest/train", train)
        i = await node.attach("i1", "guest/infer", infer)
        assert t is not None and i is not None
        assert t.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == train_pct
        assert i.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == infer_pct
        # best-effort clients at MPS's below-normal priority, latency-critical ones at normal (the default)
        assert t.env["CUDA_MPS_CLIENT_PRIORITY"] == "1" and "CUDA_MPS_CLIENT_PRIORITY" not in i.env
        await node.detach("t1")
        s = await node.attach("t2", "guest/small", small)  # a limit below the cap stays the cap
        assert s is not None and s.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    finally:
        await node.close()


@pytest.mark.parametrize("on", [True, False], ids=["priority", "priority-off"])
async def test_a_retargeted_preload_takes_the_functions_priority_unless_switched_off(tmp_path: Path, on: bool) -> None:
    """A pre-loaded container's worker makes its context after /init, so a training function that takes it
    gets below-normal priority with its cap (both travel in its init environment); with
    `--no-gpu-mps-best-effort-priority` every client stays at normal priority."""
    from dilu_invoker.invoker.dataplane.core import _mps_cap

    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        check_every_s=3600, best_effort_priority=on)
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", backend="process", mps=sup)
    await node.start()
    try:
        # the GPU's mode says it (the `GPU sharing mode` log line and dilu_gpu_mps_enabled's reason)
        said = "best-effort clients at below-normal priority" if on else "every client at normal priority"
        assert sup.decisions[0].enabled and said in sup.decisions[0].reason
        pre = await node.attach("pre", "preload:python:3-gpu",
                                GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.01, sm_limit=0.05, memory_mb=1024))
        assert pre is not None and "CUDA_MPS_CLIENT_PRIORITY" not in pre.env
        train = GpuNeeds(gpu_class=GpuClass.TRAINING, sm_request=0.2, sm_limit=0.7, memory_mb=1000)
        assert await node.retarget("pre", "guest/train", train, new_id="t1")
        taken = node.attachment_of("t1")
        assert taken is not None and taken.env.get("CUDA_MPS_CLIENT_PRIORITY") == ("1" if on else None)
        assert _mps_cap(taken) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70",
                                   **({"CUDA_MPS_CLIENT_PRIORITY": "1"} if on else {})}
    finally:
        await node.close()


def test_a_docker_best_effort_client_carries_its_priority(tmp_path: Path) -> None:
    from dilu_invoker.gpu.mps import MpsDaemon

    daemon = MpsDaemon(gpu_index=0, gpu_uuid=GPU.uuid, directory=tmp_path / "gpu0", control=FAKE)
    assert daemon.client(0.5, backend="docker", below_normal=True).env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in daemon.client(0.5, backend="docker").env


async def test_a_preloaded_mps_client_takes_the_functions_cap_and_a_running_one_keeps_its_own(tmp_path: Path) -> None:
    """An MPS client's cap is fixed with its CUDA context. A pre-loaded container makes none before /init
    (the pool tells it not to), so retargeting its placeholder gives it the function's cap; an instance
    that already runs cannot change its cap, so its retarget to another limit is refused."""
    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        check_every_s=3600)
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", backend="process", mps=sup)
    await node.start()
    try:
        pre = await node.attach("pre", "preload:python:3-gpu",
                                GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.01, sm_limit=0.05, memory_mb=1024))
        assert pre is not None and pre.mps_client and pre.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "5"
        assert await node.retarget("pre", "guest/classify", NEEDS, new_id="inst-1")
        taken = node.attachment_of("inst-1")
        assert taken is not None and taken.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
        assert taken.env["DILU_SHIM_CONTROL"] == pre.env["DILU_SHIM_CONTROL"]  # the same shim blocks
        other = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.2, sm_limit=0.3, memory_mb=1000)
        assert not await node.retarget("inst-1", "guest/other", other)
        still = node.attachment_of("inst-1")
        assert still is not None and still.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    finally:
        await node.close()


def test_a_taken_mps_containers_init_environment_carries_its_cap() -> None:
    from dilu_invoker.gpu.attachment import GpuAttachment
    from dilu_invoker.invoker.dataplane.core import _mps_cap

    mps = GpuAttachment(env={"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"})
    assert _mps_cap(mps) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"}
    assert _mps_cap(GpuAttachment(env={"CUDA_VISIBLE_DEVICES": "0"})) == {}
    assert _mps_cap(None) == {}


async def test_a_preloaded_client_with_a_context_is_retargeted_only_at_its_own_cap(tmp_path: Path) -> None:
    """A pre-loaded container attached at a cap chosen ahead makes its CUDA context at it: a function whose
    cap there now is that cap takes it (the attachment, cap among it, stays); one of another cap does not,
    and nothing changes; `mps_cap` is that comparison's other side, None without MPS."""
    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        check_every_s=3600)
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", backend="process", mps=sup)
    plain = GpuNode(node="invoker1", devices=(GPU,), shm_dir=tmp_path / "shm1", backend="process")
    placeholder = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.01, sm_limit=0.05, memory_mb=1024)
    await node.start()
    try:
        assert node.mps_cap("guest/classify", NEEDS) == pytest.approx(0.7)
        assert node.mps_cap("guest/classify", NEEDS, gpu_index=3) is None  # not on this node
        assert plain.mps_cap("guest/classify", NEEDS) is None  # time-sliced: no cap
        pre = await node.attach("pre", "preload:python:3-gpu", placeholder, mps_threads=0.7)
        assert pre is not None and pre.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
        assert node.manager(0).mps_threads_of("pre") == pytest.approx(0.7)
        other = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.2, sm_limit=0.3, memory_mb=1000)
        assert not await node.retarget("pre", "guest/other", other, new_id="inst-0")
        kept = node.attachment_of("pre")
        assert kept is pre and node.attachment_of("inst-0") is None
        (still,) = [i for g in node.view() for i in g.instances]
        assert (still.id, still.function) == ("pre", "preload:python:3-gpu")
        # 0.704 is 70 % for MPS: the same cap
        close = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.4, sm_limit=0.704, memory_mb=1000)
        assert await node.retarget("pre", "guest/classify", close, new_id="inst-1")
        taken = node.attachment_of("inst-1")
        assert taken is pre and node.manager(0).mps_threads_of("inst-1") == pytest.approx(0.7)
        (mine,) = [i for g in node.view() for i in g.instances]
        assert (mine.id, mine.function, mine.limit) == ("inst-1", "guest/classify", 0.704)
    finally:
        await node.close()
