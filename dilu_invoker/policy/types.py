"""Frozen value types shared by the policies, the GPU manager, the balancer and the simulator.

Units: SM shares are fractions of one GPU's SM time (0..1); memory is MiB (float, so GiB figures such
as 2.5 GiB convert exactly); times are float seconds on whatever clock the caller uses (`now` is always
passed in, never read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

#: Tolerance for sums of float shares and memory: 0.3 + 0.3 + 0.4 must fit in 1.0.
EPS = 1e-9


class InstanceClass(StrEnum):
    """What an instance is for; decides its priority on a shared GPU."""

    INFERENCE = "inference"
    """Latency-critical: gets up to its limit while it has demand."""
    LLM = "llm"
    """Latency-critical, like inference on a GPU; placement may split its memory over GPUs of one invoker
    (`PlacementConfig.llm_max_parts`)."""
    TRAINING = "training"
    """Best-effort: takes what latency-critical instances leave, throttled first."""

    @property
    def latency_critical(self) -> bool:
        return self is not InstanceClass.TRAINING

    @classmethod
    def parse(cls, value: str) -> InstanceClass:
        """Accept the class names used by load reports, traces and Dilu's artifact."""
        aliases = {
            "llm-inference": cls.LLM,
            "best-effort": cls.TRAINING,
            "latency-critical": cls.INFERENCE,
        }
        key = value.strip().lower()
        if key in aliases:
            return aliases[key]
        try:
            return cls(key)
        except ValueError:
            raise ValueError(
                f"unknown instance class {value!r}; expected one of {[c.value for c in cls]}"
            ) from None


class Profile(StrEnum):
    """What bounds an instance's speed, from the profiler; complementary profiles share a GPU well."""

    COMPUTE = "compute"
    MEMORY = "memory"

    @property
    def opposite(self) -> Profile:
        return Profile.MEMORY if self is Profile.COMPUTE else Profile.COMPUTE


class GpuRef(NamedTuple):
    """Where a GPU is: its invoker and the GPU's index there (NVML / CUDA_VISIBLE_DEVICES numbering).

    A named tuple so hashing and ordering are cheap; the field is `gpu` because `index` would shadow
    `tuple.index`.
    """

    invoker: str
    gpu: int

    def __str__(self) -> str:
        return f"{self.invoker}/gpu{self.gpu}"


def check_share(name: str, value: float) -> None:
    if not (
        isinstance(value, int | float)
        and math.isfinite(value)
        and 0.0 <= value <= 1.0 + EPS
    ):
        raise ValueError(f"{name} must be a share between 0 and 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class SharePair:
    """An instance's `<request, limit>`: guaranteed share and the most it may ever get."""

    request: float
    limit: float

    def __post_init__(self) -> None:
        check_share("request", self.request)
        check_share("limit", self.limit)
        if self.request > self.limit + EPS:
            raise ValueError(f"request {self.request} exceeds limit {self.limit}")


@dataclass(frozen=True, slots=True)
class PlacedInstance:
    """One instance as placement sees it on each GPU it occupies.

    `memory_mib` is per GPU; an instance spanning `gpus` GPUs (a gang, e.g. data-parallel training)
    appears on each with the same request, limit and memory.
    """

    id: str
    function: str
    cls: InstanceClass
    request: float
    limit: float
    memory_mib: float
    gpus: int = 1
    profile: Profile | None = None
    part_of: str | None = None
    """Set on each piece of an instance whose memory placement split across GPUs of one invoker
    (an LLM's pipeline stages): the id of the whole instance. None for an ordinary instance."""

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("instance id must not be empty")
        if self.part_of is not None and (not self.part_of or self.gpus != 1):
            raise ValueError(f"part {self.id} must name its instance and occupy one GPU")
        SharePair(self.request, self.limit)
        if not (math.isfinite(self.memory_mib) and self.memory_mib >= 0):
            raise ValueError(f"memory_mib must be >= 0, got {self.memory_mib!r}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU and what is placed on it, with the sums placement needs precomputed."""

    ref: GpuRef
    memory_mib: float
    uuid: str = ""
    sm_count: int = 0
    instances: tuple[PlacedInstance, ...] = ()
    schedulable: bool = True
    """False while the GPU (or its invoker) drains: nothing new lands there."""
    weight_groups: frozenset[tuple[str, float]] = frozenset()
    """The shared read-only weights the GPU holds, as (group, MiB): an instance of such a group placed
    here needs its memory less the weights (its invoker's budget counts them once per GPU; docs/balancer.md
    "Shared weights"). The group names a function revision; only the GPU's own invoker's instances count."""
    used_request: float = field(init=False)
    used_limit: float = field(init=False)
    used_memory: float = field(init=False)
    n_latency: int = field(init=False)
    n_best_effort: int = field(init=False)
    n_compute: int = field(init=False)
    n_memory: int = field(init=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.memory_mib) and self.memory_mib > 0):
            raise ValueError(
                f"GPU {self.ref} memory_mib must be > 0, got {self.memory_mib!r}"
            )
        req = lim = mem = 0.0
        n_lc = n_comp = n_mem = 0
        for inst in self.instances:
            req += inst.request
            lim += inst.limit
            mem += inst.memory_mib
            n_lc += inst.cls.latency_critical
            n_comp += inst.profile is Profile.COMPUTE
            n_mem += inst.profile is Profile.MEMORY
        setattr_ = object.__setattr__
        setattr_(self, "used_request", req)
        setattr_(self, "used_limit", lim)
        setattr_(self, "used_memory", mem)
        setattr_(self, "n_latency", n_lc)
        setattr_(self, "n_best_effort", len(self.instances) - n_lc)
        setattr_(self, "n_compute", n_comp)
        setattr_(self, "n_memory", n_mem)

    @property
    def lit(self) -> bool:
        """A GPU is lit (powered for tenants, counted by the evaluation) while anything is placed on it."""
        return bool(self.instances)

    @property
    def free_memory(self) -> float:
        return self.memory_mib - self.used_memory

    def with_instances(self, instances: tuple[PlacedInstance, ...]) -> GpuState:
        return GpuState(
            ref=self.ref,
            memory_mib=self.memory_mib,
            uuid=self.uuid,
            sm_count=self.sm_count,
            instances=instances,
            schedulable=self.schedulable,
            weight_groups=self.weight_groups,
        )
