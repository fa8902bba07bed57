"""The configuration tree: mechanical flag/env names, OpenWhisk aliases, and its documentation."""

from __future__ import annotations

import re
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


RCKM_GONE = ("the rckm vertical policy it tuned is gone; slo is the time-sliced policy now, tuned by "
             "--gpu-vertical-slo-factor, --gpu-vertical-deadband, --gpu-vertical-increase-per-s, "
             "--gpu-vertical-decrease and --gpu-vertical-dwell-s (docs/policies.md §1.1)")


@pytest.mark.parametrize(("argv", "environ", "message"), [
    (["--gpu-vertical-rckm", "busy_ceiling=0.8"], {}, f"--gpu-vertical-rckm was removed: {RCKM_GONE}"),
    ([], {"DILU_GPU_VERTICAL_RCKM": "busy_ceiling=0.8"}, f"DILU_GPU_VERTICAL_RCKM was removed: {RCKM_GONE}; unset it"),
    (["--gpu-vertical-rckm", ""], {}, "--gpu-vertical-rckm was removed"),  # an empty flag is still the flag
    (["--gpu-vertical-policy", "rckm"], {},
     "--gpu-vertical-policy rckm was removed: slo replaced it as the time-sliced policy (docs/policies.md §1.2); "
     "use one of auto, slo, static, spatial"),
    ([], {"DILU_GPU_VERTICAL_POLICY": "rckm"}, "--gpu-vertical-policy rckm was removed"),
], ids=["flag", "env", "empty-flag", "policy-flag", "policy-env"])
def test_removed_settings_are_refused_by_name(argv: list[str], environ: dict[str, str], message: str) -> None:
    args = cli.build_parser().parse_args(["invoker", *argv])
    with pytest.raises(config.ConfigError, match=f"^{re.escape(message)}"):
        config.load(args, environ=environ)


def test_an_empty_removed_variable_sets_nothing() -> None:
    cfg = config.load(environ={"DILU_GPU_VERTICAL_RCKM": " "})
    assert cfg == config.load(environ={})


def test_removed_settings_are_neither_settings_nor_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert config.REMOVED_SETTINGS
    names = {(s.section, s.name) for s in config.settings()}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["invoker", "--help"])
    listed = capsys.readouterr().out
    assert "--gpu-vertical-policy" in listed
    for r in config.REMOVED_SETTINGS:
        assert (r.section, r.name) not in names
        assert r.flag not in config.describe() and r.flag not in listed


def test_the_cli_refuses_a_removed_flag_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["invoker", "--gpu-vertical-rckm", "busy_ceiling=0.8"]) == 2
    err = capsys.readouterr().err
    assert err == f"dilu-invoker invoker: error: --gpu-vertical-rckm was removed: {RCKM_GONE}\n"


def test_live_compaction_settings_reach_the_planner_and_are_checked() -> None:
    from dilu_invoker.loadbalancer.service import planner_config

    env = {"DILU_BALANCER_COMPACTION_MAX_REQUEST": "1.0", "DILU_BALANCER_COMPACTION_MERGES": "2",
           "DILU_BALANCER_COMPACTION_MEMORY_MERGES": "1", "DILU_BALANCER_COMPACTION_REPACKS": "8"}
    live = planner_config(config.load(environ=env)).compaction
    assert live is not None
    assert (live.config.source_max_request, live.config.merges, live.config.memory_merges,
            live.config.max_moves, live.config.repacks, live.config.repack_live) == (1.0, 2, 1, 2, 8, True)
    default = planner_config(config.load(environ={})).compaction
    assert default is not None
    assert (default.config.source_max_request, default.config.merges, default.config.memory_merges,
            default.config.repacks) == (0.5, 0, 0, 0)
    with pytest.raises(config.ConfigError, match="--balancer-compaction-max-request"):
        config.load(environ={"DILU_BALANCER_COMPACTION_MAX_REQUEST": "1.5"})
    with pytest.raises(config.ConfigError, match="--balancer-compaction-merges"):
        config.load(environ={"DILU_BALANCER_COMPACTION_MERGES": "-1"})
    with pytest.raises(config.ConfigError, match="--balancer-compaction-memory-merges"):
        config.load(environ={"DILU_BALANCER_COMPACTION_MEMORY_MERGES": "-1"})
    with pytest.raises(config.ConfigError, match="--balancer-compaction-repacks"):
        config.load(environ={"DILU_BALANCER_COMPACTION_REPACKS": "-1"})


def test_node_fit_reaches_the_planners_placement() -> None:
    from dilu_invoker.loadbalancer.service import planner_config

    assert planner_config(config.load(environ={"DILU_BALANCER_SPLIT_NODE_FIT": "true"})).placement.split_node_fit
    assert not planner_config(config.load(environ={})).placement.split_node_fit
    args = cli.build_parser().parse_args(["balancer", "--balancer-split-node-fit"])
    assert planner_config(config.load(args, environ={})).placement.split_node_fit
