"""Compaction as the live balancer runs it: its default plan settings (`LIVE_COMPACTION`), its period
(`LiveCompaction`) and which functions may have instances moved (`function_calm`). The balancer's planner and
the serving simulator both take them from here, so that they move the same instances."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dilu_invoker.policy.compaction import CompactionConfig
from dilu_invoker.policy.horizontal import FunctionLoad, ScaleAction, ScaleDecision

#: Compaction as the live balancer runs it by default: only GPUs with Σ request ≤ 0.5 and at most 3
#: instances are emptied, 32 per run, 2 moves a run. A pipeline stage of a split instance may move to another GPU
#: of its invoker (the invoker hands it over while the pipeline serves, `CommandOp.MOVE_STAGE`), a split
#: instance may be placed anew, and a move may split the llm instance it moves (`move_pieces`; the
#: `--balancer-compaction-stages` switch). A run merges no SM room by default; one that does
#: (`--balancer-compaction-merges`) looks as the simulator's does: at up to 256 GPUs with lost room per merging move,
#: emptying only GPUs of one instance meanwhile (docs/benchmarks/sim-scale.md, twenty-seventh round: on 0:0.4 the
#: simulator's packing for fewer cold starts and less CPU than 16 GPUs and 2 instances). A run moves each instance
#: at most once (`one_move_per_instance`): the invoker hands one stage over at a time. A run that merges free memory
#: (`--balancer-compaction-memory-merges`, none by default) does so only while the lit GPUs exceed the integral bound
#: of what is placed by more than 0.5% (`memory_merge_above`; docs/benchmarks/sim-scale.md, twenty-eighth round: at
#: the bound, as on the mixes with 20-40% training and few LLMs, ungated memory merges cost 30 cold starts per 100
#: instances for nothing). Re-packing is make-before-break here (`repack_live`: no displacing, a split instance placed
#: anew away from its old GPUs) and gated at 2.5% over the bound (`repack_above`); none runs by default
#: (`--balancer-compaction-repacks`, 0; docs/benchmarks/sim-scale.md, twenty-ninth round).
LIVE_COMPACTION = CompactionConfig(source_max_request=0.5, max_sources=32, max_moves=2, move_pieces=True,
                                   merge_sources=256, merge_source_instances=1, one_move_per_instance=True,
                                   memory_merge_above=0.005, repack_live=True, repack_above=0.025)


def live_compaction_config(*, max_moves: int = LIVE_COMPACTION.max_moves,
                           max_request: float = LIVE_COMPACTION.source_max_request,
                           merges: int = LIVE_COMPACTION.merges,
                           memory_merges: int = LIVE_COMPACTION.memory_merges,
                           stages: bool = LIVE_COMPACTION.move_pieces,
                           repacks: int = LIVE_COMPACTION.repacks) -> CompactionConfig:
    """`LIVE_COMPACTION` with the balancer's settings: `--balancer-compaction-max-moves` (moves a run),
    `--balancer-compaction-max-request` (which GPUs it may empty), `--balancer-compaction-merges` (moves a
    run may spend merging SM room), `--balancer-compaction-memory-merges` (moves a run may spend merging free
    memory, where memory binds), `--balancer-compaction-stages` (split instances: stage moves, placing one
    anew, splitting on a move) and `--balancer-compaction-repacks` (lit GPUs a run may try to turn off by
    re-packing them). The balancer, the serving simulator and `simulate placement --as-live` all build it here."""
    return replace(LIVE_COMPACTION, max_moves=max_moves, source_max_request=max_request, merges=merges,
                   memory_merges=memory_merges, move_pieces=stages, repacks=repacks)


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveCompaction:
    """Compaction on the live cluster: the same `compaction_plan` the simulator runs."""

    config: CompactionConfig = LIVE_COMPACTION
    """`max_moves` bounds the replacements one run starts (each is a cold start). With `move_pieces`, a move may
    also split the llm instance it moves over up to `PlacementConfig.llm_max_parts` GPUs, as placement would;
    without, compaction never touches a split instance and never splits."""
    period_s: float = 30.0
    """At most one run this often, and none while a move it started is still in flight."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"compaction period_s must be > 0, got {self.period_s!r}")
        if self.config.rebalances:
            # A resize re-cuts a serving pipeline where it is: no live action does that.
            raise ValueError("live compaction cannot resize pipeline stages: rebalances must be 0")
        if self.config.memory_rebalances:
            raise ValueError("live compaction cannot resize pipeline stages: memory_rebalances must be 0")
        if self.config.repacks and not self.config.repack_live:
            # Such a re-pack cuts a stage anew on the GPUs its old pipeline serves from, or displaces an instance.
            raise ValueError("live compaction re-packs only make-before-break: repacks needs repack_live")


def function_calm(decision: ScaleDecision, load: FunctionLoad, owed: int) -> bool:
    """No compaction move touches a function unless it is calm: the scaler holds, nothing is owed,
    starting or stopping, no activation waits, no instance is saturated, and its instances' capacity
    covers the arrival rate (a burst the lazy scaler rides out is not calm). The serving simulator
    applies the same rule to its own load figures."""
    if decision.action is not ScaleAction.HOLD or owed or load.waiting or load.instances_at_limit:
        return False
    if load.starting or load.stopping:
        return False
    cap = load.capacity_per_instance
    return not (cap and load.arrival_rate > cap * load.instances)
