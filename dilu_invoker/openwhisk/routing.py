"""Where an activation taken from ``invoker{N}`` runs, and how GPU docker actions are recognised.

Two ways of getting GPU work to dilu-invoker inside an existing OpenWhisk (``docs/openwhisk-cluster.md``):

(a) *all-dilu*: every invoker is a dilu-invoker and ``python:3-gpu`` is an ordinary manifest kind. The
    controller may hand a GPU activation to any invoker; that invoker asks :class:`Router` where it should
    run (the balancer's routing tables pick the placed instance, possibly on another node) and still acks
    to the controller itself, so the controller's slot accounting stays right. The routing tables arrive
    with the balancer; until then :class:`LocalRouter` runs everything here.

(b) *GPU pool as the blackbox set*: only GPU nodes run dilu-invoker, GPU actions are docker actions
    (``wsk action create f main.py --docker <gpu image>``) and the controller sends every docker action
    to the blackbox invokers. :func:`gpu_image_action` turns such an action into one of our GPU kind when
    its image is one we are configured to treat as a GPU image.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import Action, ActivationRequest, Exec


class Router(Protocol):
    async def route(self, req: ActivationRequest) -> ActivationRunner:
        """The runner that executes ``req`` (this node's invoker, or a forwarder to another one)."""
        ...


class LocalRouter:
    """Everything runs on this invoker."""

    def __init__(self, local: ActivationRunner) -> None:
        self.local = local

    async def route(self, req: ActivationRequest) -> ActivationRunner:
        return self.local


@dataclass(frozen=True, slots=True)
class GpuImages:
    """Docker images whose actions run as our GPU kind.

    An entry with a tag (``org/gpu-python:1.0``) matches that tag only; one without a tag matches every
    tag of the image; ``docker.io/`` and ``library/`` prefixes are ignored on both sides.
    """

    images: tuple[str, ...] = ()
    gpu_kind: str | None = None

    @classmethod
    def parse(cls, spec: str, *, manifest: Manifest, gpu_kind: str | None = None) -> GpuImages:
        images = tuple(i for i in (part.strip().strip("'\"[]") for part in spec.split(",")) if i)
        kind = gpu_kind or next((k for k in sorted(manifest.runtimes) if manifest.runtimes[k].gpu
                                 and not manifest.runtimes[k].deprecated), None)
        if images and kind is None:
            raise ValueError("GPU images are configured but the runtimes manifest has no GPU kind")
        return cls(images=images, gpu_kind=kind)

    def matches(self, image: str) -> bool:
        name, tag = _split(image)
        for entry in self.images:
            e_name, e_tag = _split(entry)
            if e_name == name and (e_tag is None or e_tag == (tag or "latest")):
                return True
        return False


def _split(image: str) -> tuple[str, str | None]:
    ref = image.strip()
    for prefix in ("docker.io/", "index.docker.io/", "library/"):
        ref = ref.removeprefix(prefix)
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon + 1:]
    return ref, None


def gpu_image_action(action: Action, gpu: GpuImages) -> Action:
    """A ``blackbox`` action whose image is a configured GPU image becomes an action of the GPU kind
    (same code, main and binary flag), so it runs in our GPU runtime under the GPU sharing machinery.
    Other actions, and GPU-image actions without code, are returned unchanged."""
    if action.exec.kind != "blackbox" or action.exec.image is None or gpu.gpu_kind is None:
        return action
    if not gpu.matches(action.exec.image) or action.exec.code is None:
        return action
    exec_ = Exec(kind=gpu.gpu_kind, code=action.exec.code, binary=action.exec.binary, main=action.exec.main)
    return replace(action, exec=exec_)


def split_list(spec: str | Iterable[str]) -> tuple[str, ...]:
    """``CONFIG_whisk_invoker_resource_tags``-style lists: comma-separated, ansible may add quotes and
    brackets (``" 'v1,gpu' "``, ``['gpu']``)."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    return tuple(p for p in (part.strip().strip("'\"[] ") for part in parts) if p)


def blackbox_fractions(invokers: int, gpu_invokers: int, *, epsilon: float = 0.001) -> tuple[float, float]:
    """Controller settings that make exactly the last ``gpu_invokers`` of ``invokers`` the blackbox set
    (``CONFIG_whisk_loadbalancer_managedFraction``, ``..._blackboxFraction``).

    The naive settings (``k/N`` and, as ansible derives it, ``1 - k/N``) are often off by one in the
    balancer's floating-point ``ceil``/``floor``; nudging both by ``epsilon`` is exact while
    ``invokers * epsilon < 1``.
    """
    if not 0 < gpu_invokers < invokers:
        raise ValueError("need at least one CPU and one GPU invoker")
    if invokers * epsilon >= 1:
        raise ValueError(f"epsilon {epsilon} is too large for {invokers} invokers")
    return (invokers - gpu_invokers) / invokers - epsilon, gpu_invokers / invokers + epsilon


def balancer_split(invokers: int, managed_fraction: float, blackbox_fraction: float) -> tuple[int, int]:
    """How ``ShardingContainerPoolBalancer`` splits ``invokers`` into (managed, blackbox) counts: the first
    ``managed`` ids get managed work, the last ``blackbox`` ids get docker actions."""
    blackbox_fraction = max(1.0 - managed_fraction, min(1.0, blackbox_fraction))
    managed = max(1, math.ceil(invokers * managed_fraction))
    blackboxes = max(1, math.floor(invokers * blackbox_fraction))
    return managed, blackboxes
