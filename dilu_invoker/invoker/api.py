"""What the fronts (the standalone REST API, the Kafka invoker) see of the invoker core."""

from __future__ import annotations

from typing import Protocol

from dilu_invoker.model import Activation, ActivationRequest, ActivationResponse, Parameter, now_ms

#: the whisk internal error of an activation that broke without an answer (OpenWhisk's wording)
MSG_ABNORMAL_RUN = "The action did not produce a valid response and exited unexpectedly."
KIND_UNKNOWN = "unknown"
CAUSED_BY_SEQUENCE = "sequence"


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


def never_ran(
    *,
    activation_id: str,
    namespace: str,
    subject: str,
    path: str,
    response: ActivationResponse,
    version: str | None = None,
    cause: str | None = None,
    now: int | None = None,
) -> Activation:
    """The record of an activation that never ran in a container — the one builder for it, in the shape
    of OpenWhisk's ``InvokerReactive.generateFallbackActivation``: zero duration, annotations ``path`` (the
    fully qualified name), ``kind: unknown`` and, in a sequence, ``causedBy: sequence``."""
    at = now_ms() if now is None else now
    annotations = [Parameter("path", path), Parameter("kind", KIND_UNKNOWN)]
    if cause is not None:
        annotations.append(Parameter("causedBy", CAUSED_BY_SEQUENCE))
    return Activation(
        namespace=namespace,
        name=path.rsplit("/", 1)[-1],
        subject=subject,
        activation_id=activation_id,
        start=at,
        end=at,
        response=response,
        version=version or "0.0.1",
        annotations=tuple(annotations),
        cause=cause,
    )


def never_ran_for(req: ActivationRequest, response: ActivationResponse) -> Activation:
    return never_ran(activation_id=req.activation_id, namespace=req.identity.namespace,
                     subject=req.identity.subject, path=req.action.fqn, response=response,
                     version=req.action.version, cause=req.cause)
