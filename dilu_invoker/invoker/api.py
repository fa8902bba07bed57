"""What the fronts (the standalone REST API, the Kafka invoker) see of the invoker core."""

from __future__ import annotations

from typing import Protocol

from dilu_invoker.model import Activation, ActivationRequest


class InvokerOverloaded(RuntimeError):
    """The invoker's queue is full: the front answers 429/503 (REST) or leaves the message unread (Kafka)."""


class ActivationRunner(Protocol):
    async def run(self, req: ActivationRequest) -> Activation:
        """Run one activation to completion and return its record, logs included.

        Never raises for anything the action or its container did: every outcome, including platform
        failures, comes back as an :class:`Activation` whose response carries OpenWhisk's status code.
        Raises :class:`InvokerOverloaded` only when the activation could not even be queued.
        """
        ...
