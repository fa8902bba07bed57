"""Building blocks for tests that drive an :class:`~dilu_invoker.invoker.dataplane.core.Invoker` directly:
a configuration with invoker settings changed, a Python action and an activation request for it."""

from __future__ import annotations

from dataclasses import replace

from dilu_invoker import config
from dilu_invoker.model import GUEST_IDENTITY, Action, ActionLimits, ActivationRequest, Exec, new_activation_id

#: prints and returns its parameter ``n``
ECHO = "def main(args):\n    print('hello', args.get('n'))\n    return {'n': args.get('n')}\n"


def config_with(**invoker: object) -> config.Config:
    """The defaults (no environment) with these ``invoker`` settings."""
    base = config.load(environ={})
    return replace(base, invoker=replace(base.invoker, **invoker))  # type: ignore[arg-type]


def python_action(code: str = ECHO, *, name: str = "echo", kind: str = "python:3", **limits: int) -> Action:
    """An action in the guest namespace whose revision follows its code (a new code: a new container)."""
    return Action(namespace="guest", name=name, exec=Exec(kind=kind, code=code),
                  limits=replace(ActionLimits(), **limits), revision=f"1-{abs(hash(code))}")


def activation(action: Action, content: object = None, **kw: object) -> ActivationRequest:
    """A guest's activation of ``action`` with ``content`` (default: no parameters)."""
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                             content=content if content is not None else {}, **kw)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is neither a zombie nor dead (/proc)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            state = next(line for line in status if line.startswith("State:")).split()[1]
    except (OSError, StopIteration):
        return False
    return state not in ("Z", "X")
