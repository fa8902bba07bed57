"""What a GPU container is given by the node's GPU manager (the invoker core merges it into the spec).

Defined here, in the GPU package, because the GPU package produces it and the invoker may import the GPU
package but not the other way round; ``dilu_invoker.invoker.dataplane.core`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GpuMount:
    """A host file bind-mounted into the container (same fields as the backends' ``Mount``)."""

    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class GpuAttachment:
    """Environment (``CUDA_VISIBLE_DEVICES``, ``LD_PRELOAD``, the shim's block paths, ``DILU_GPU_UUID``),
    bind mounts (the shim, its control block read-only, its stats block) and device nodes."""

    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[GpuMount, ...] = ()
    devices: tuple[str, ...] = ()
    gpu_index: int | None = None
    uuid: str = ""
