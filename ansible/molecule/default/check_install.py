"""Reads the invoker's environment file the way systemd and dilu-supervise read it, loads dilu-invoker's
configuration from it and pings the Redis it names. Prints one JSON object (verify.yml asserts on it).

Runs with the installed release's Python: ``check_install.py ENV_FILE SUPERVISOR``.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import redis

from dilu_invoker import config


def main(env_file: str, supervisor: str) -> dict[str, object]:
    spec = importlib.util.spec_from_file_location("dilu_supervise", supervisor)
    assert spec is not None and spec.loader is not None
    supervise = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(supervise)
    env = supervise.read_env_file(env_file)
    known = set()
    for s in config.settings():
        known.add(s.env)
        known.update(s.env_aliases)
    cfg = config.load(environ=env)
    ping = None
    if cfg.redis.url:
        client = redis.Redis.from_url(cfg.redis.url, socket_timeout=5)
        ping = bool(client.ping())
        client.close()
    return {
        "names": sorted(env),
        "unknown": sorted(set(env) - known),
        "redis_ping": ping,
        "redis_scheme": (cfg.redis.url or "").split(":", 1)[0],
        "invoker_password": cfg.invoker.password,
        "invoker_user": cfg.invoker.user,
        "user_memory_mb": cfg.invoker.user_memory_mb,
        "port": cfg.invoker.port,
        "kafka_hosts": cfg.kafka.hosts,
        "couchdb": [cfg.couchdb.host, cfg.couchdb.port, cfg.couchdb.username],
        "whisks_db": cfg.whisks_db,
        "activations_db": cfg.activations_db,
        "manifest": cfg.invoker.runtimes_manifest,
        "shim_path": cfg.gpu.shim_path,
        "gpu_enabled": cfg.gpu.enabled,
        "unique_name": cfg.invoker.unique_name,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
