"""Write tests/sim/data/synthetic_profiles.json: a SYNTHETIC profile fixture (a formula, not a measurement).

    /work/venv/bin/python tests/sim/make_synthetic_profiles.py

The simulator's tests and, until the H200 profiles are shipped, the evaluation's serving runs use it.
Model (per function, milliseconds at the whole GPU): a batch of b needs `work = w0 + w1·b`; it can
use at most `sat(b) = min(1, s0 + k·b)` of the SMs, so at share s its latency is
`overhead + work / min(1, s / sat(b))`. The numbers are plausible orders of magnitude for an H200
running the models in eager PyTorch; they are not measured and must never be presented as such.
The recommended `<request, limit>` and batch come from the same hybrid growth search the profiler
runs (dilu_invoker.policy.profiling), applied to the formula.
"""

from __future__ import annotations

import json
from pathlib import Path

from dilu_invoker.policy import (
    InstanceClass,
    Measurement,
    SearchConfig,
    hybrid_growth_search,
    training_search,
)

OUT = Path(__file__).parent / "data" / "synthetic_profiles.json"

#: name -> (class, memory MiB, SLO ms, overhead ms, w0, w1, s0, k, training batch)
MODELS = {
    "resnet50": (InstanceClass.INFERENCE, 1900.0, 50.0, 0.8, 2.5, 0.45, 0.12, 0.03, None),
    "bert-base": (InstanceClass.INFERENCE, 2300.0, 80.0, 1.0, 3.5, 1.1, 0.15, 0.05, None),
    "train-resnet50": (InstanceClass.TRAINING, 14000.0, None, 2.0, 8.0, 1.5, 0.25, 0.03, 32),
}


def latency_ms(name: str, share: float, batch: int) -> float:
    _, _, _, overhead, w0, w1, s0, k, _ = MODELS[name]
    sat = min(1.0, s0 + k * batch)
    return overhead + (w0 + w1 * batch) / min(1.0, share / sat)


def build() -> dict[str, object]:
    config = SearchConfig(step=0.1, max_batch=64)
    functions: dict[str, object] = {}
    for name, (cls, mem, slo, *_rest) in MODELS.items():
        train_batch = MODELS[name][-1]

        def measure(share: float, batch: int, name: str = name) -> Measurement:
            lat = latency_ms(name, share, batch)
            return Measurement(share, batch, lat, batch * 1000.0 / lat)

        if cls is InstanceClass.TRAINING:
            assert train_batch is not None
            result = training_search(measure, batch=train_batch, config=config)
            batches: tuple[int, ...] = (train_batch,)
        else:
            assert slo is not None
            result = hybrid_growth_search(measure, slo_ms=slo, config=config)
            batches = config.batch_sizes()
        points = []
        for b in batches:
            for s in config.shares():
                m = measure(s, b)
                points.append(
                    {
                        "sm_share": s,
                        "batch": b,
                        "latency_ms": round(m.latency_ms, 4),
                        "throughput_rps": round(m.throughput_rps, 3),
                    }
                )
        entry: dict[str, object] = {"class": cls.value, "memory_mib": mem}
        if slo is not None:
            entry["slo_ms"] = slo
        entry["points"] = points
        entry["recommended"] = {"request": result.request, "limit": result.limit, "batch": result.batch}
        functions[name] = entry
    return {
        "format": "dilu-profiles",
        "version": 1,
        "synthetic": True,
        "source": "SYNTHETIC: tests/sim/make_synthetic_profiles.py (a latency formula, not a measurement)",
        "device": "none (formula)",
        "functions": functions,
    }


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {OUT}")
