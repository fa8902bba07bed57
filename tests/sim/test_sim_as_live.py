"""`simulate placement --as-live`: dilu with the live balancer's own default settings (what a live cluster
packs), taken from the same objects the balancer builds its planner from."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from dilu_invoker.config import BalancerConfig, Config
from dilu_invoker.loadbalancer.service import planner_config
from dilu_invoker.sim.cli import main
from dilu_invoker.sim.placement import live_placement_config


@pytest.fixture(scope="module")
def llm_events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ev") / "llm.jsonl.gz"
    assert main(["gen", "placement", "--instances", "240", "--train-fraction", "0.2", "--llm-fraction", "0.4",
                 "--seed", "5", "--out", str(path)]) == 0
    return path


def test_the_live_profile_is_what_the_balancer_runs_by_default() -> None:
    """The balancer's planner from a default configuration: this compaction, this often, and LLMs split into
    at most `--balancer-max-stages` (4) stages, which only actions declaring gpu-stages are (the simulator's
    `--as-live` by default: none declares it). If a live default changes, `--as-live` follows (or this fails)."""
    live = planner_config(Config())
    sim = live_placement_config()
    assert live.compaction is not None
    assert sim.placement_config().llm_max_parts == 1
    assert live_placement_config(llm_split_parts=4).placement_config().llm_max_parts == live.placement.llm_max_parts
    assert live.placement.llm_max_parts == Config().balancer.max_stages == 4
    # Stage moves and splitting moves are on (--balancer-compaction-stages); stages hold whole MiB, as budgets do.
    assert sim.compaction_splits and sim.compaction.move_pieces and sim.whole_mib_stages
    assert Config().balancer.compaction_stages
    off = planner_config(Config(balancer=BalancerConfig(compaction_stages=False)))
    assert off.compaction is not None and not off.compaction.config.move_pieces
    assert not live_placement_config(compaction=off.compaction.config).compaction_splits
    assert sim.compaction == live.compaction.config and sim.compact_every_s == live.compaction.period_s
    assert sim.placement_config().gamma == live.placement.gamma and sim.policy == live.placement.strategy


def test_as_live_splits_nothing_and_says_what_it_ran(llm_events: Path, tmp_path: Path) -> None:
    runs = {}
    for name, argv in (("default", []), ("live", ["--as-live"])):
        out = tmp_path / name
        assert main(["placement", "--events", str(llm_events), "--policy", "dilu", "--gpu-memory-gib", "40",
                     "--out", str(out), "--quiet", "--no-plots", *argv]) == 0
        runs[name] = json.loads((out / "details.json").read_text())
    live, default = runs["live"], runs["default"]
    # The simulator's default splits LLMs over GPUs; the live balancer places one-GPU instances only.
    assert default["split_instances"] > 0 and default["llm_split_parts"] == 4
    assert live["split_instances"] == 0 and live["llm_split_parts"] == 1
    assert live["compact_every_s"] == 30.0 and live["compaction"] == asdict(live_placement_config().compaction)
    assert live["compaction"]["source_max_request"] == 0.5 and live["compaction"]["merges"] == 0
    assert default["compaction"]["merges"] == 1 and default["compact_every_s"] == 2.0
    # Each is a placement of every instance; without splits the same trace needs at least as many GPUs.
    assert live["integral_bound_peak"] == default["integral_bound_peak"]
    assert live["peak_vs_integral"] >= default["peak_vs_integral"]


def test_as_live_splits_the_llms_of_actions_declaring_stages(llm_events: Path, tmp_path: Path) -> None:
    runs = {}
    for name, argv in (("live", []), ("stages", ["--llm-split-parts", "4"])):
        out = tmp_path / name
        assert main(["placement", "--events", str(llm_events), "--policy", "dilu", "--gpu-memory-gib", "40",
                     "--as-live", "--out", str(out), "--quiet", "--no-plots", *argv]) == 0
        runs[name] = json.loads((out / "details.json").read_text())
    live, stages = runs["live"], runs["stages"]
    assert stages["split_instances"] > 0 and stages["llm_split_parts"] == 4 and live["split_instances"] == 0
    assert stages["compaction"] == live["compaction"] and stages["compact_every_s"] == 30.0
    assert stages["peak_vs_integral"] <= live["peak_vs_integral"]


def test_as_live_takes_a_period(llm_events: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    assert main(["placement", "--events", str(llm_events), "--policy", "dilu", "--as-live", "--compact-every", "10",
                 "--out", str(out), "--quiet", "--no-plots"]) == 0
    details = json.loads((out / "details.json").read_text())
    assert details["compact_every_s"] == 10.0 and details["llm_split_parts"] == 1


@pytest.mark.parametrize("flag", [["--compact-max-sources", "4"], ["--compact-max-instances", "2"]])
def test_as_live_refuses_the_flags_it_sets(llm_events: Path, tmp_path: Path, flag: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["placement", "--events", str(llm_events), "--policy", "dilu", "--as-live", *flag,
               "--out", str(tmp_path / "x"), "--quiet", "--no-plots"])
    assert rc == 2
    assert f"error: --as-live takes the live balancer's settings; not with {flag[0]}" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_as_live_takes_the_balancers_compaction_settings(llm_events: Path, tmp_path: Path) -> None:
    """`--compact-max-request`, `--compact-merges`, `--compact-memory-merges` and `--compact-repacks` with `--as-live`
    are the balancer's `--balancer-compaction-max-request`, `-merges`, `-memory-merges` and `-repacks`: the same
    `CompactionConfig` as the planner built from them."""
    out = tmp_path / "k"
    assert main(["placement", "--events", str(llm_events), "--policy", "dilu", "--as-live", "--compact-max-request",
                 "1.0", "--compact-merges", "1", "--compact-memory-merges", "2", "--compact-repacks", "3",
                 "--out", str(out), "--quiet", "--no-plots"]) == 0
    details = json.loads((out / "details.json").read_text())
    live = planner_config(Config(balancer=BalancerConfig(compaction_max_request=1.0, compaction_merges=1,
                                                         compaction_memory_merges=2, compaction_repacks=3)))
    assert live.compaction is not None
    assert details["compaction"] == asdict(live.compaction.config)
    assert details["compaction"]["source_max_request"] == 1.0 and details["compaction"]["merges"] == 1
    assert details["compaction"]["memory_merges"] == 2
    assert details["split_node_fit"] is False
    assert details["compaction"]["repacks"] == 3 and details["compaction"]["repack_live"] is True
    assert details["compaction"]["max_moves"] == 2 and details["llm_split_parts"] == 1
    # --no-compact-pieces is --balancer-compaction-stages false.
    out = tmp_path / "off"
    assert main(["placement", "--events", str(llm_events), "--policy", "dilu", "--as-live", "--no-compact-pieces",
                 "--out", str(out), "--quiet", "--no-plots"]) == 0
    details = json.loads((out / "details.json").read_text())
    off = planner_config(Config(balancer=BalancerConfig(compaction_stages=False)))
    assert off.compaction is not None and details["compaction"] == asdict(off.compaction.config)
    assert details["compaction"]["move_pieces"] is False and details["compaction_splits"] is False


@pytest.mark.parametrize(("max_request", "merges", "memory_merges", "repacks"),
                         [(0.5, 0, 0, 0), (1.0, 1, 0, 0), (1.0, 2, 1, 0), (1.0, 2, 1, 8)])
def test_the_serving_simulator_compacts_as_the_balancer_configured_alike(max_request: float, merges: int,
                                                                         memory_merges: int, repacks: int) -> None:
    from dilu_invoker.sim.serving import ServingSimConfig

    sim = ServingSimConfig(policy="dilu", gpus=8, compaction_max_request=max_request, compaction_merges=merges,
                           compaction_memory_merges=memory_merges, compaction_repacks=repacks,
                           compaction_max_moves=3).live_compaction()
    live = planner_config(Config(balancer=BalancerConfig(compaction_max_request=max_request,
                                                         compaction_merges=merges,
                                                         compaction_memory_merges=memory_merges,
                                                         compaction_repacks=repacks,
                                                         compaction_max_moves=3)))
    assert sim is not None and live.compaction is not None
    assert sim == live.compaction
    with pytest.raises(ValueError, match="compaction_max_request"):
        ServingSimConfig(policy="dilu", gpus=8, compaction_max_request=1.2)
    with pytest.raises(ValueError, match="compaction_repacks"):
        ServingSimConfig(policy="dilu", gpus=8, compaction_repacks=-1)


def test_as_live_takes_the_balancers_node_fit(llm_events: Path, tmp_path: Path) -> None:
    """`--split-node-fit` with `--as-live` is the balancer's `--balancer-split-node-fit`: the planner's placement
    setting, reported in the run's details."""
    out = tmp_path / "f"
    assert main(["placement", "--events", str(llm_events), "--policy", "dilu", "--as-live", "--split-node-fit",
                 "--out", str(out), "--quiet", "--no-plots"]) == 0
    details = json.loads((out / "details.json").read_text())
    assert details["split_node_fit"] is True
    assert planner_config(Config(balancer=BalancerConfig(split_node_fit=True))).placement.split_node_fit
