"""Prometheus metrics of one invoker, with OpenWhisk's ``openwhisk_action_*`` names where one exists
(the user-events service's ``PrometheusRecorder``) and ``dilu_*`` names for what OpenWhisk lacks.

Each invoker owns its registry, so several invokers in one process (standalone ``--invokers N``) do not
clash and tests read exact values.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dilu_invoker.model import Activation

_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LABELS = ("namespace", "initiator", "action")


class InvokerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.activations = Counter("openwhisk_action_activations", "Activations run by this invoker",
                                   (*_LABELS, "kind", "memory"), registry=r)
        self.cold_starts = Counter("openwhisk_action_coldStarts", "Activations that started a container",
                                   _LABELS, registry=r)
        self.status = Counter("openwhisk_action_status", "Activations by response status",
                              (*_LABELS, "status"), registry=r)
        self.wait_time = Histogram("openwhisk_action_waitTime_seconds", "Time from arrival to init or run start",
                                   _LABELS, buckets=_TIME_BUCKETS, registry=r)
        self.init_time = Histogram("openwhisk_action_initTime_seconds", "Initialization time of cold starts",
                                   _LABELS, buckets=_TIME_BUCKETS, registry=r)
        self.duration = Histogram("openwhisk_action_duration_seconds", "Activation duration (init included)",
                                  _LABELS, buckets=_TIME_BUCKETS, registry=r)
        self.memory = Gauge("openwhisk_action_memory", "Memory limit of the action's containers (MB)",
                            _LABELS, registry=r)
        self.containers = Gauge("dilu_invoker_containers", "Action containers by state", ("state",), registry=r)
        self.queue_length = Gauge("dilu_invoker_queue_length", "Activations waiting for a container", registry=r)
        self.memory_in_use = Gauge("dilu_invoker_memory_in_use_mb", "Memory of live action containers (MB)",
                                   registry=r)
        self.user_memory = Gauge("dilu_invoker_user_memory_mb", "Memory this invoker offers actions (MB)",
                                 registry=r)
        self.enabled = Gauge("dilu_invoker_enabled", "1 while the invoker takes work", registry=r)
        self._children: dict[tuple[str, str, str], tuple[Histogram, Gauge, Histogram]] = {}
        self._counted: dict[tuple[tuple[str, str, str], str, int], Counter] = {}

    def record(self, activation: Activation, *, kind: str, memory_mb: int, wait_ms: int | None,
               init_ms: int | None) -> None:
        path = str(activation.annotation("path", activation.name))
        action = path.split("/", 1)[1] if "/" in path else path
        labels = (activation.namespace, activation.subject, action)
        # The labelled children of one action, looked up once (``labels()`` locks and builds a key per call).
        per_action = self._children.get(labels)
        if per_action is None:
            per_action = self._children[labels] = (
                self.duration.labels(*labels), self.memory.labels(*labels), self.wait_time.labels(*labels))
        duration, memory, wait_time = per_action
        counted = self._counted.get((labels, kind, memory_mb))
        if counted is None:
            counted = self._counted[(labels, kind, memory_mb)] = self.activations.labels(*labels, kind, str(memory_mb))
        counted.inc()
        self.status.labels(*labels, activation.response.status.api_string).inc()
        duration.observe(activation.duration / 1000)
        memory.set(memory_mb)
        if wait_ms is not None:
            wait_time.observe(max(0, wait_ms) / 1000)
        if init_ms is not None:
            self.cold_starts.labels(*labels).inc()
            self.init_time.labels(*labels).observe(init_ms / 1000)
