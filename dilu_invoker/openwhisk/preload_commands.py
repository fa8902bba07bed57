"""Model pre-loading in cluster mode, the invoker's half: the balancer's ``preload`` and ``release``
commands (docs/balancer.md, "Model pre-loading in cluster mode") carried out by the same
``ModelPreloader`` standalone uses (``invoker/dataplane/model_preload.py``: its cap
``--invoker-model-preload-mb``, idle GPU room and host memory only, straight to staged exit).

``preload`` names the action (``function``, ``rev``) and the GPU the balancer chose; the action is read
from CouchDB at that revision (the document the controller wrote, its code attachment included), turned
into its GPU kind where ``--invoker-gpu-images`` says so, and loaded — on that GPU when it has the idle
room, else on this invoker's GPU with the most. A newer revision's ``preload`` replaces the older pre-load
(one load of an action at a time); ``release`` lets it go, also while the document is still being read.
Nothing here fails a command stream: an action that cannot be read is logged and counted ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog

from dilu_invoker.invoker.cluster.instances import InstanceManager
from dilu_invoker.invoker.dataplane.core import Invoker
from dilu_invoker.invoker.dataplane.model_preload import ModelPreloader, ModelPreloads, budget_room
from dilu_invoker.openwhisk.couchdb import ActionFetchError, ActionStore
from dilu_invoker.openwhisk.routing import GpuImages, gpu_image_action
from dilu_invoker.wire import CommandOp, InstanceCommand

log = structlog.get_logger(__name__)


class PreloadCommands:
    def __init__(self, preloads: ModelPreloads, actions: ActionStore, *, gpu: GpuImages | None = None) -> None:
        self.preloads = preloads
        self.actions = actions
        self.gpu = gpu or GpuImages()
        self._generation: dict[str, int] = {}  # fqn -> bumped by every command for it
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def preloader(self) -> ModelPreloader:
        return self.preloads.preloaders[0]

    def attach(self, instances: InstanceManager) -> None:
        for op in (CommandOp.PRELOAD, CommandOp.RELEASE):
            instances.other_ops[op.value] = self.handle

    def handle(self, cmd: InstanceCommand) -> str:
        """Carry out one command (the instance manager checked its epoch and boot)."""
        fqn = cmd.function
        generation = self._generation[fqn] = self._generation.get(fqn, 0) + 1
        if cmd.op == CommandOp.RELEASE:
            self.preloads.released(fqn, cmd.reason or "released by the balancer")
            return "release"
        if not self.preloads.enabled:
            log.info("model pre-load not taken: pre-loading is off on this invoker", action=fqn,
                     reason=self.preloader.why_off)
            return "preload-off"
        task = asyncio.ensure_future(self._preload(cmd, generation))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return "preload"

    async def _preload(self, cmd: InstanceCommand, generation: int) -> None:
        path, _, name = cmd.function.rpartition("/")
        try:
            action = await self.actions.get(path, name, cmd.rev or None)
        except ActionFetchError as exc:
            self.preloader.metrics.events.labels("failed").inc()
            log.warning("model pre-load failed: the action could not be read", action=cmd.function, rev=cmd.rev,
                        error=exc.detail)
            return
        if self._generation.get(cmd.function) != generation:
            log.info("model pre-load dropped: a later command for the action came meanwhile", action=cmd.function)
            return
        held = self.preloader.holding(action.fqn)
        if held is not None and held.action.revision == action.revision:
            log.info("model pre-load already held", action=action.fqn, rev=action.revision)
            return
        log.info("model pre-load commanded by the balancer", action=action.fqn, rev=action.revision, gpu=cmd.gpu,
                 reason=cmd.reason)
        self.preloads.stored(gpu_image_action(action, self.gpu), gpu_index=cmd.gpu)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.preloads.close()


@contextlib.asynccontextmanager
async def preload_commands(invoker: Invoker, instances: InstanceManager, actions: ActionStore, *, cap_mb: int,
                           gpu: GpuImages | None = None) -> AsyncIterator[PreloadCommands]:
    """Take the balancer's pre-load commands for the block (the room a pre-load may use: the invoker's GPUs'
    budgets in the agent's Redis); what is pre-loaded goes before the invoker closes (with its keeper)."""
    budgets = instances.budgets
    room = budget_room(budgets, getattr(invoker.gpu, "devices", ())) if budgets is not None else None
    preloader = ModelPreloader(invoker, cap_mb=cap_mb, room=room)
    commands = PreloadCommands(ModelPreloads([preloader], debounce_s=0.0), actions, gpu=gpu)
    commands.attach(instances)
    try:
        yield commands
    finally:
        for op in (CommandOp.PRELOAD, CommandOp.RELEASE):
            instances.other_ops.pop(op.value, None)
        await commands.close()
