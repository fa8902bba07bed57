"""What a GPU container is given by the node's GPU manager (the invoker core merges it into the spec).

Defined here, in the GPU package, because the GPU package produces it and the invoker may import the GPU
package but not the other way round; ``dilu_invoker.invoker.dataplane.core`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: set in an MPS client's environment: the daemon's pipe directory, and the spatial cap it connects with
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
#: MPS client priority (read when the client makes its context): 0 normal, 1 below normal; where clients of
#: both levels have work waiting, the GPU schedules the normal ones' kernels first
MPS_PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
MPS_PRIORITY_BELOW_NORMAL = "1"


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

    @property
    def mps_client(self) -> bool:
        """Whether the container connects to the GPU's MPS daemon (its cap is fixed when it makes its context)."""
        return MPS_PIPE_ENV in self.env
