"""Doubles for what the invoker core provides: an :class:`ActivationRunner` and the enable switch.

:class:`ScriptedRunner` behaves like the core from the front's point of view (it returns the full
activation record, never raises for action failures) and takes its behaviour from the action's code, a
JSON object:

``{"sleep": s, "status": 0..3, "error": msg, "result": value, "big": n, "logs": [...],
  "overloaded": n, "raise": true}``; any other code echoes the parameters.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from dilu_invoker.invoker.api import InvokerOverloaded
from dilu_invoker.model import (
    Activation,
    ActivationRequest,
    ActivationResponse,
    ActivationStatus,
    Parameter,
    json_size,
    now_ms,
)


def spec_of(req: ActivationRequest) -> dict[str, Any]:
    try:
        spec = json.loads(req.action.exec.code or "")
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


class ScriptedRunner:
    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.requests: dict[str, ActivationRequest] = {}
        self.refused: Counter[str] = Counter()
        self.running = 0
        self.max_running = 0

    async def run(self, req: ActivationRequest) -> Activation:
        spec = spec_of(req)
        if self.refused[req.activation_id] < int(spec.get("overloaded", 0)):
            self.refused[req.activation_id] += 1
            raise InvokerOverloaded("pool full")
        if spec.get("raise"):
            raise RuntimeError("scripted runner failure")
        self.runs[req.activation_id] += 1
        self.requests[req.activation_id] = req
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        start = now_ms()
        try:
            if spec.get("sleep"):
                await asyncio.sleep(float(spec["sleep"]))
        finally:
            self.running -= 1
        end = now_ms()
        status = ActivationStatus(int(spec.get("status", 0)))
        if status is ActivationStatus.SUCCESS:
            if "big" in spec:
                result: Any = {"blob": "x" * int(spec["big"])}
            elif "result" in spec:
                result = spec["result"]
            else:
                result = req.content if req.content is not None else {}
            response = ActivationResponse.success(result, size=json_size(result))
        else:
            response = ActivationResponse(status, {"error": spec.get("error", "scripted failure")})
        annotations = [
            Parameter("path", req.action.fqn),
            Parameter("waitTime", max(0, start - (req.transid_start_ms or start))),
            Parameter("kind", req.action.exec.kind),
            Parameter("timeout", False),
            Parameter("limits", req.action.limits.to_json()),
        ]
        if req.cause is not None:
            annotations.append(Parameter("causedBy", "sequence"))
        if req.binding is not None:
            annotations.append(Parameter("binding", req.binding))
        logs = tuple(f"2026-01-01T00:00:00.000000000Z stdout: {line}" for line in spec.get("logs", ()))
        return Activation(
            namespace=req.identity.namespace,
            name=req.action.name,
            subject=req.identity.subject,
            activation_id=req.activation_id,
            start=start,
            end=end,
            response=response,
            logs=logs,
            version=req.action.version,
            annotations=tuple(annotations),
            cause=req.cause,
        )


class Switch:
    """The ``/enable``/``/disable`` state the core's HTTP server owns."""

    def __init__(self) -> None:
        self._enabled = True
        self._callbacks: list[Callable[[bool], None]] = []

    @property
    def enabled(self) -> bool:
        return self._enabled

    def on_enabled_change(self, callback: Callable[[bool], None]) -> None:
        self._callbacks.append(callback)

    def set(self, enabled: bool) -> None:
        self._enabled = enabled
        for callback in self._callbacks:
            callback(enabled)
