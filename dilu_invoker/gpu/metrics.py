"""Prometheus metrics of the GPU manager, registered in the invoker's registry (docs/gpu-manager.md).

Per instance (labels ``namespace, action, instance, gpu, uuid``): the share in force, request and limit,
and counters fed from the stats block's monotonic counters (tokens granted in thread blocks, kernel
launches, throttled seconds, request spans and their lengths) plus the device memory in use. Per GPU (``gpu, uuid``): Dilu's fragmentation
``1 − Σ request`` (0 on a GPU with nothing placed), NVML's SM utilisation, the vertical mode and the
number of decisions per mode, and the vertical policy the GPU runs with the reason (``dilu_gpu_vertical_policy``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dilu_invoker.gpu.manager import GpuLabel, InstanceSpec, InstanceStatus, Reading
from dilu_invoker.policy.vertical import FeedbackMode

_INSTANCE = ("namespace", "action", "instance", "gpu", "uuid")
SPAN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Request spans from a millisecond (a graph replay) to seconds (an LLM request)."""
_GPU = ("gpu", "uuid")


def _instance_labels(spec: InstanceSpec, gpu: GpuLabel) -> tuple[str, str, str, str, str]:
    ns, action = spec.namespace_action
    return ns, action, spec.id, str(gpu.index), gpu.uuid


class GpuMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.quota = Gauge("openwhisk_action_gpu_sm_quota_ratio", "SM share in force (0..1)", _INSTANCE, registry=r)
        self.limit = Gauge("openwhisk_action_gpu_sm_limit_ratio", "SM limit of the instance", _INSTANCE, registry=r)
        self.request = Gauge("openwhisk_action_gpu_sm_request_ratio", "SM request of the instance", _INSTANCE,
                             registry=r)
        self.tokens = Counter("openwhisk_action_gpu_tokens_granted", "Thread blocks admitted by the shim",
                              _INSTANCE, registry=r)
        self.launches = Counter("openwhisk_action_gpu_kernel_launches", "Kernel and graph launches", _INSTANCE,
                                registry=r)
        self.throttled = Counter("openwhisk_action_gpu_kernel_throttled_seconds",
                                 "Time launches waited for tokens (summed over threads)", _INSTANCE, registry=r)
        self.spans = Counter("openwhisk_action_gpu_request_spans",
                             "Request spans (first launch to a quiet application sync) completed", _INSTANCE,
                             registry=r)
        self.span_seconds = Histogram("openwhisk_action_gpu_request_span_seconds",
                                      "Request span lengths (at most the newest 24 per manager period)", _INSTANCE,
                                      buckets=SPAN_BUCKETS, registry=r)
        self.memory = Gauge("openwhisk_action_gpu_memory_used_bytes", "Device memory held through the shim",
                            _INSTANCE, registry=r)
        self.rate = Gauge("dilu_gpu_rate_blocks_per_ms", "Token rate in the control block (0 = unlimited)",
                          _INSTANCE, registry=r)
        self.capacity = Gauge("dilu_gpu_capacity_blocks_per_ms",
                              "Capacity estimate used to turn the share into a rate (NaN = unknown)",
                              _INSTANCE, registry=r)
        self.fragmentation = Gauge("openwhisk_invoker_gpu_fragmentation_ratio",
                                   "SM fragmentation 1 - sum of requests (Dilu; 0 when nothing is placed)",
                                   _GPU, registry=r)
        self.utilization = Gauge("dilu_gpu_sm_utilization_ratio", "GPU utilisation from NVML (0..1)", _GPU,
                                 registry=r)
        self.mode = Gauge("dilu_gpu_vertical_mode", "1 for the vertical policy's current mode", (*_GPU, "mode"),
                          registry=r)
        self.decisions = Counter("dilu_gpu_vertical_decisions", "Vertical policy decisions by mode",
                                 (*_GPU, "mode"), registry=r)
        self.mode_changes = Counter("dilu_gpu_vertical_mode_changes", "Changes of the vertical policy's mode "
                                    "(logged at info only for a cut and a return to the limits)",
                                    (*_GPU, "from_mode", "to_mode"), registry=r)
        self.policy = Gauge("dilu_gpu_vertical_policy", "1 for the vertical policy the GPU runs; reason says why "
                            "(--gpu-vertical-policy auto: spatial under MPS, slo when time-sliced)",
                            (*_GPU, "policy", "reason"), registry=r)
        self._last_mode: dict[tuple[str, str], FeedbackMode] = {}
        self._policy_labels: dict[tuple[str, str], tuple[str, str]] = {}

    def observe_instance(self, spec: InstanceSpec, gpu: GpuLabel, status: InstanceStatus, reading: Reading) -> None:
        labels = _instance_labels(spec, gpu)
        self.quota.labels(*labels).set(status.share)
        self.limit.labels(*labels).set(spec.limit)
        self.request.labels(*labels).set(spec.request)
        self.rate.labels(*labels).set(status.rate_blocks_per_ms)
        cap = status.capacity_blocks_per_ms
        self.capacity.labels(*labels).set(cap if cap is not None else float("nan"))
        # Readings are differences of the shim's monotonic counters (restarts already accounted for).
        self.tokens.labels(*labels).inc(max(0, reading.blocks))
        self.launches.labels(*labels).inc(max(0, reading.launches))
        self.throttled.labels(*labels).inc(max(0.0, reading.throttled_s))
        self.spans.labels(*labels).inc(max(0, reading.spans))
        for span in reading.spans_s:
            self.span_seconds.labels(*labels).observe(span)
        self.memory.labels(*labels).set(reading.mem_used_bytes)

    def observe_gpu(self, gpu: GpuLabel, *, fragmentation: float, utilization: float | None,
                    mode: FeedbackMode, decided: bool) -> None:
        labels = (str(gpu.index), gpu.uuid)
        self.fragmentation.labels(*labels).set(fragmentation)
        if utilization is not None:
            self.utilization.labels(*labels).set(utilization)
        for m in FeedbackMode:
            self.mode.labels(*labels, m.value).set(1 if m is mode else 0)
        if decided:
            self.decisions.labels(*labels, mode.value).inc()
        last = self._last_mode.get(labels)
        if last is not None and last is not mode:
            self.mode_changes.labels(*labels, last.value, mode.value).inc()
        self._last_mode[labels] = mode

    def observe_policy(self, gpu: GpuLabel, *, policy: str, reason: str) -> None:
        labels = (str(gpu.index), gpu.uuid)
        old = self._policy_labels.get(labels)
        if old is not None and old != (policy, reason):
            try:
                self.policy.remove(*labels, *old)
            except KeyError:
                pass
        self.policy.labels(*labels, policy, reason).set(1)
        self._policy_labels[labels] = (policy, reason)

    def forget_instance(self, spec: InstanceSpec, gpu: GpuLabel) -> None:
        labels = _instance_labels(spec, gpu)
        for metric in (self.quota, self.limit, self.request, self.tokens, self.launches, self.throttled,
                       self.spans, self.span_seconds, self.memory, self.rate, self.capacity):
            try:
                metric.remove(*labels)
            except KeyError:
                pass  # never observed (removed before its first tick)
