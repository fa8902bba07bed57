"""What the staged-exit tests through `standalone` share: one simulated GPU, weights kept for 30 s, no
pre-loading (of processes or models), a balancer that scales an idle function to zero after 1 s."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dilu_invoker import config


def metric(text: str, name: str, **labels: str) -> float:
    """A sample of a Prometheus text exposition (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def gpu_kind_preloaded(manifest: dict) -> str:
    """``manifest`` (a runtimes manifest) as JSON, its GPU kind pre-loaded with an empty list: the interpreter
    and the runtime only (torch is not here to import), so its pre-loaded containers start on this machine."""
    manifest = json.loads(json.dumps(manifest))
    for entry in manifest["runtimes"]["python"]:
        if entry["kind"] == "python:3-gpu":
            entry["preload"] = []
    return json.dumps(manifest)


def staged_config(tmp_path: Path, uuid: str, memory_mb: int = 16000) -> config.Config:
    (tmp_path / "inventory.json").write_text(json.dumps([{"uuid": uuid, "memory_mb": memory_mb}]))
    base = config.load(environ={})
    return replace(base, data_dir=str(tmp_path / "data"), api=replace(base.api, port=0),
                   gpu=replace(base.gpu, inventory=str(tmp_path / "inventory.json"), mps="off"),
                   invoker=replace(base.invoker, weights_grace_s=30.0, preload=0, model_preload_mb=0),
                   balancer=replace(base.balancer, tick_s=0.2, report_period_s=0.2, report_ttl_s=1.0,
                                    scale_to_zero_after_s=1.0, cooldown_s=0.2))
