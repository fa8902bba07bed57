"""`ClusterSnapshot.with_states` (a few GPUs' states replaced, only they indexed again) equals `build` of the
same GPUs, field for field and to the last bit of the float sums, over random sequences of changes: instances
started, stopped and moved, gangs over two GPUs, pieces of split instances, large training slots, GPUs drained
and opened, and the cases `build` decides globally or rejects (a GPU's capacity changed, an instance listed
twice on one GPU, one described differently on two GPUs)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dilu_invoker.policy import ClusterSnapshot, GpuRef, GpuState, InstanceClass, PlacedInstance
from dilu_invoker.policy.types import Profile

GIB = 1024.0


class World:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.n = 0
        self.states: list[GpuState] = []
        for k in range(rng.randint(1, 4)):
            for i in range(rng.randint(1, 4)):
                self.states.append(GpuState(ref=GpuRef(f"inv{k}", i), memory_mib=40 * GIB, uuid=f"u{k}.{i}"))
        rng.shuffle(self.states)  # `build` orders them; the snapshot's ordinals are its order
        self.states = list(ClusterSnapshot.build(now=0.0, gpus=self.states).gpus)
        for _ in range(rng.randint(0, 12)):
            self.start()

    def new(self, *, gpus: int = 1, part_of: str | None = None) -> PlacedInstance:
        rng = self.rng
        self.n += 1
        cls = rng.choice([InstanceClass.INFERENCE, InstanceClass.TRAINING, InstanceClass.LLM])
        return PlacedInstance(
            id=f"i{self.n}", function=f"f{rng.randrange(5)}", cls=cls,
            request=rng.choice([0.1, 0.2, 0.3, 0.6]), limit=1.0,
            memory_mib=rng.choice([2 * GIB, 5.5 * GIB, 25 * GIB]), gpus=gpus, part_of=part_of,
            profile=rng.choice([None, Profile.COMPUTE, Profile.MEMORY]),
        )

    def on(self, o: int, *instances: PlacedInstance) -> None:
        self.states[o] = self.states[o].with_instances(self.states[o].instances + instances)

    def start(self) -> None:
        rng, states = self.rng, self.states
        roll = rng.random()
        o = rng.randrange(len(states))
        same_node = [k for k, g in enumerate(states) if g.ref.invoker == states[o].ref.invoker and k != o]
        if roll < 0.2 and same_node:  # a gang over two GPUs
            gang = self.new(gpus=2)
            self.on(o, gang)
            self.on(rng.choice(same_node), gang)
        elif roll < 0.35 and same_node:  # two pieces of a split instance
            whole = f"w{self.n}"
            self.on(o, self.new(part_of=whole))
            self.on(rng.choice(same_node), self.new(part_of=whole))
        else:
            self.on(o, self.new())

    def step(self) -> None:
        rng, states = self.rng, self.states
        for _ in range(rng.choice([1, 1, 2, 3, 6])):
            roll = rng.random()
            o = rng.randrange(len(states))
            g = states[o]
            if roll < 0.35:
                self.start()
            elif roll < 0.6 and g.instances:  # an instance stopped (a gang's other GPU keeps it until stopped)
                gone = rng.choice(g.instances).id
                if rng.random() < 0.7:
                    self.states = [s.with_instances(tuple(i for i in s.instances if i.id != gone)) if any(
                        i.id == gone for i in s.instances) else s for s in states]
                else:
                    states[o] = g.with_instances(tuple(i for i in g.instances if i.id != gone))
            elif roll < 0.72 and g.instances:  # moved to another GPU
                moved = rng.choice(g.instances)
                if moved.gpus == 1:
                    states[o] = g.with_instances(tuple(i for i in g.instances if i.id != moved.id))
                    self.on(rng.randrange(len(states)), moved)
            elif roll < 0.8:  # drained or opened
                states[o] = replace(g, schedulable=not g.schedulable)
            elif roll < 0.84:  # the same state read again (another object)
                states[o] = replace(g)
            elif roll < 0.87:  # kept weights
                states[o] = replace(g, weight_groups=g.weight_groups ^ {("grp", 512.0)})
            elif roll < 0.89:  # capacity changed: `build` recomputes the large-slot threshold
                states[o] = replace(g, memory_mib=g.memory_mib + GIB)
            elif roll < 0.91 and g.instances:  # listed twice on one GPU
                states[o] = g.with_instances(g.instances + (g.instances[0],))
            elif roll < 0.93:  # an instance described differently on a second GPU (`build` rejects it)
                placed = [i for s in states for i in s.instances if i.gpus == 1]
                if placed:
                    bad = replace(rng.choice(placed), request=0.05)
                    self.on(o, bad)


def _build(states: list[GpuState], now: float) -> ClusterSnapshot | ValueError:
    try:
        return ClusterSnapshot.build(now=now, gpus=states)
    except ValueError as exc:
        return exc


@pytest.mark.parametrize("seed", range(40))
def test_with_states_equals_build(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    derived = 0
    real = ClusterSnapshot._with_states

    def counting(self: ClusterSnapshot, *args: object) -> ClusterSnapshot | None:
        nonlocal derived
        out = real(self, *args)  # type: ignore[arg-type]
        derived += out is not None
        return out

    monkeypatch.setattr(ClusterSnapshot, "_with_states", counting)
    rng = random.Random(seed)
    world = World(rng)
    last = ClusterSnapshot.build(now=0.0, gpus=world.states)
    for k in range(1, 80):
        before = list(world.states)
        world.step()
        changes = {o: s for o, s in enumerate(world.states) if s is not before[o]}
        want = _build(world.states, float(k))
        if isinstance(want, ValueError):
            with pytest.raises(ValueError, match="described differently"):
                last.with_states(float(k), changes)
            world.states = before  # the bad change is not kept
            continue
        got = last.with_states(float(k), changes)
        assert got == want, f"step {k}"
        assert (got.sum_request, got.sum_memory, got.sum_memory_fraction) == (
            want.sum_request, want.sum_memory, want.sum_memory_fraction)
        last = got
    assert derived > 10  # the incremental path, not the fallback, answered most steps


def test_unchanged_gpus_are_shared_and_a_wrong_ordinal_is_refused() -> None:
    a = PlacedInstance(id="a", function="f", cls=InstanceClass.INFERENCE, request=0.2, limit=0.4, memory_mib=GIB)
    c = ClusterSnapshot.uniform(invokers=2, gpus_per_invoker=2, memory_mib=40 * GIB)
    c1 = c.with_states(3.0, {1: c.gpus[1].with_instances((a,))})
    assert c1.now == 3.0 and c1.instance_gpus("a") == (GpuRef("invoker0", 1),) and c1.lit_count == 1
    assert c1.gpus[0] is c.gpus[0] and c1.gpus[2] is c.gpus[2]
    assert c1 == ClusterSnapshot.build(now=3.0, gpus=list(c1.gpus))
    assert c.with_states(4.0, {}) == c.at(4.0)
    with pytest.raises(ValueError, match="ordinal 2"):
        c.with_states(1.0, {2: c.gpus[1]})
    with pytest.raises(ValueError, match="ordinal 9"):
        c.with_states(1.0, {9: c.gpus[1]})


@pytest.mark.parametrize("seed", range(6))
def test_with_states_after_placements_equals_build_over_many_chunks(seed: int) -> None:
    """Over a cluster of several 64-GPU chunks, `with_states` of a snapshot that `with_instance` and
    `without_instance` derived (which move the totals by each change and mark its chunk stale) still equals
    `build` to the last bit: the stale chunks and the changed ones are summed again, the others reused."""
    rng = random.Random(seed)
    snap = ClusterSnapshot.uniform(invokers=40, gpus_per_invoker=8, memory_mib=40 * GIB)
    assert len(snap.gpus.chunks) == 5
    n = 0
    for k in range(1, 60):
        for _ in range(rng.randint(1, 8)):  # placements and removals, as a compaction plan makes them
            placed = list(snap.locations)
            if placed and rng.random() < 0.4:
                snap = snap.without_instance(rng.choice(placed))
            else:
                n += 1
                ref = snap.refs[rng.randrange(len(snap.refs))]
                inst = PlacedInstance(id=f"p{n}", function=f"f{n % 7}", cls=InstanceClass.INFERENCE,
                                      request=rng.choice([0.1, 0.15, 0.3]), limit=1.0,
                                      memory_mib=rng.choice([1.5 * GIB, 3.3 * GIB, 7 * GIB]))
                snap = snap.with_instance(inst, (ref,))
        assert snap.dirty_chunks  # the totals were moved, the chunks not summed again
        states = list(snap.gpus)
        changes: dict[int, GpuState] = {}
        for o in rng.sample(range(len(states)), rng.randint(1, 6)):  # a few GPUs read anew, elsewhere
            n += 1
            states[o] = changes[o] = states[o].with_instances(states[o].instances + (PlacedInstance(
                id=f"s{n}", function="g", cls=InstanceClass.LLM, request=0.05, limit=0.5, memory_mib=0.7 * GIB),))
        got = snap.with_states(float(k), changes)
        want = ClusterSnapshot.build(now=float(k), gpus=states)
        assert got == want, f"step {k}"
        assert (got.sum_request, got.sum_memory, got.sum_memory_fraction) == (
            want.sum_request, want.sum_memory, want.sum_memory_fraction), f"step {k}"
        assert got.chunk_sums == want.chunk_sums and not got.dirty_chunks
        snap = got
