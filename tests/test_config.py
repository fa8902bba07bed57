"""The configuration tree: mechanical flag/env names, OpenWhisk aliases, and its documentation."""

from __future__ import annotations

from pathlib import Path

import pytest

from dilu_invoker import cli, config

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_documentation_lists_every_setting() -> None:
    # docs/configuration.md is generated from the code; a new setting must be documented.
    assert config.describe() in DOC.read_text()


def test_precedence_flag_over_dilu_env_over_openwhisk_name() -> None:
    env = {"DILU_KAFKA_HOSTS": "dilu:9092", "KAFKA_HOSTS": "ow:9092", "CONFIG_whisk_couchdb_host": "couch"}
    assert config.load(environ=env).kafka.hosts == "dilu:9092"
    assert config.load(environ={"KAFKA_HOSTS": "ow:9092"}).kafka.hosts == "ow:9092"
    args = cli.build_parser().parse_args(["invoker", "--kafka-hosts", "flag:9092", "--id", "3"])
    cfg = config.load(args, environ=env)
    assert (cfg.kafka.hosts, cfg.invoker.id, cfg.couchdb.host) == ("flag:9092", 3, "couch")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DILU_API_PORT": "many"}, "DILU_API_PORT"),
        ({"DILU_INVOKER_BACKEND": "lxc"}, "--invoker-backend"),
        ({"DILU_GPU_GAMMA": "0.5"}, "--gpu-gamma"),
        ({"DILU_LOG_LEVEL": "loud"}, "--log-level"),
    ],
    ids=["not-a-number", "unknown-backend", "gamma-below-one", "bad-log-level"],
)
def test_invalid_settings_name_the_setting(environ: dict[str, str], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.load(environ=environ)


def test_secure_defaults() -> None:
    cfg = config.load(environ={})
    assert cfg.api.host == "127.0.0.1" and cfg.invoker.host == "127.0.0.1"
    assert cfg.invoker.password is None  # a random one is generated at start
    assert cfg.redis.url is None  # the embedded Redis gets a random password


def test_the_vertical_policy_and_its_knobs_come_from_flags_and_env() -> None:
    from dilu_invoker.policy.vertical_slo import PerGpuVertical, SloConfig, SpatialConfig

    # auto is the default: spatial where a GPU runs MPS, slo where it time-slices (the node resolves it)
    assert config.load(environ={}).gpu.vertical() == PerGpuVertical(name="auto", mps=SpatialConfig(),
                                                                     time_sliced=SloConfig())
    # the slo knobs tune the time-sliced choice of auto and spatial too
    spatial = config.load(cli.build_parser().parse_args(["invoker", "--gpu-vertical-policy", "spatial",
                                                         "--gpu-vertical-spatial-lc-reserve", "0.3"]),
                          environ={"DILU_GPU_VERTICAL_DEADBAND": "0.2"}).gpu.vertical()
    assert spatial == PerGpuVertical(name="spatial", mps=SpatialConfig(lc_reserve=0.3),
                                     time_sliced=SloConfig(deadband=0.2))
    reserve = config.load(environ={"DILU_GPU_VERTICAL_SPATIAL_LC_RESERVE": "0.25",
                                   "DILU_GPU_VERTICAL_SPATIAL_LC_THREADS": "0.6"}).gpu.vertical()
    assert reserve.mps == SpatialConfig(lc_reserve=0.25, lc_threads=0.6)
    flag = cli.build_parser().parse_args(["invoker", "--gpu-vertical-spatial-lc-threads", "0.5"])
    assert config.load(flag, environ={}).gpu.vertical().mps == SpatialConfig(lc_threads=0.5)
    reach = cli.build_parser().parse_args(["invoker", "--gpu-vertical-spatial-be-threads", "1.0"])
    assert config.load(reach, environ={}).gpu.vertical().mps == SpatialConfig(be_threads=1.0)
    assert config.load(environ={"DILU_GPU_VERTICAL_SPATIAL_BE_THREADS": "0.7"}).gpu.vertical().mps == SpatialConfig(
        be_threads=0.7)
    env = {"DILU_GPU_VERTICAL_POLICY": "slo", "DILU_GPU_VERTICAL_DEADBAND": "0.2", "DILU_GPU_VERTICAL_DWELL_S": "0.3"}
    args = cli.build_parser().parse_args(["invoker", "--gpu-vertical-decrease", "0.5",
                                          "--gpu-vertical-mps-best-effort-threads", "0.6"])
    got = config.load(args, environ=env).gpu.vertical()
    assert got == SloConfig(deadband=0.2, dwell_s=0.3, decrease=0.5, mps_best_effort_threads=0.6)
    static = config.load(environ={"DILU_GPU_VERTICAL_POLICY": "static"}).gpu.vertical()
    assert type(static).__name__ == "StaticConfig"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DILU_GPU_VERTICAL_POLICY": "pid"}, "--gpu-vertical-policy must be one of auto, slo, static, spatial"),
        ({"DILU_GPU_VERTICAL_SPATIAL_LC_RESERVE": "1.5"}, "lc_reserve must be in"),
        ({"DILU_GPU_VERTICAL_SPATIAL_LC_THREADS": "0"}, "lc_threads must be in"),
        ({"DILU_GPU_VERTICAL_SPATIAL_BE_THREADS": "1.2"}, "be_threads must be in"),
        ({"DILU_GPU_VERTICAL_POLICY": "slo", "DILU_GPU_VERTICAL_DECREASE": "1.5"}, "decrease must be in"),
        ({"DILU_GPU_VERTICAL_DECREASE": "1.5"}, "decrease must be in"),  # auto's time-sliced choice: slo
        ({"DILU_GPU_VERTICAL_POLICY": "rckm"}, "--gpu-vertical-policy rckm was removed: slo replaced it"),
    ],
    ids=["unknown-policy", "spatial-reserve-out-of-range", "spatial-lc-threads-zero", "spatial-be-threads-above-one",
         "slo-knob-out-of-range", "auto-slo-knob-out-of-range", "removed-policy"],
)
def test_invalid_vertical_settings_fail_at_start_up(environ: dict[str, str], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.load(environ=environ)


def test_live_compaction_settings_reach_the_planner_and_are_checked() -> None:
    from dilu_invoker.loadbalancer.service import planner_config

    env = {"DILU_BALANCER_COMPACTION_MAX_REQUEST": "1.0", "DILU_BALANCER_COMPACTION_MERGES": "2"}
    live = planner_config(config.load(environ=env)).compaction
    assert live is not None
    assert (live.config.source_max_request, live.config.merges, live.config.max_moves) == (1.0, 2, 2)
    default = planner_config(config.load(environ={})).compaction
    assert default is not None and (default.config.source_max_request, default.config.merges) == (0.5, 0)
    with pytest.raises(config.ConfigError, match="--balancer-compaction-max-request"):
        config.load(environ={"DILU_BALANCER_COMPACTION_MAX_REQUEST": "1.5"})
    with pytest.raises(config.ConfigError, match="--balancer-compaction-merges"):
        config.load(environ={"DILU_BALANCER_COMPACTION_MERGES": "-1"})
