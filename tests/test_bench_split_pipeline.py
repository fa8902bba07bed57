"""bench/split_pipeline.py end to end on the CPU, tiny: real runtime processes, the whole model in one and its
stages in others (torch where installed, else the numpy model), and the report says what it measured."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def run_bench(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out, raw = tmp_path / "split.md", tmp_path / "split.json"
    command = [sys.executable, "bench/split_pipeline.py", "--device", "cpu", "--d-model", "32", "--heads", "2",
               "--vocab", "64", "--seq", "8", "--batch", "2", "--warmup", "1", "--out", str(out), "--json", str(raw), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(raw.read_text()), out.read_text()


@pytest.mark.parametrize(("stages", "layers", "client"), [(2, 4, ()), (3, 5, ("--plain-client",))], ids=["2-stages", "3-stages-plain-client"])
def test_the_split_model_computes_what_the_whole_one_does_and_both_are_timed(
    tmp_path: Path, stages: int, layers: int, client: tuple[str, ...]
) -> None:
    requests = 4
    raw, text = run_bench(tmp_path, "--stages", str(stages), "--layers", str(layers), "--requests", str(requests), *client)
    assert raw["backend"].startswith("torch" if HAS_TORCH else "numpy")
    assert raw["client"] == ("plain aiohttp" if client else "RuntimeClient")
    assert raw["max_abs_diff"] < 1e-3 and raw["max_abs_logit"] > 0.01  # equal, and not because all is zero
    assert raw["same_next_tokens"] is True
    for mode in ("whole", "split"):
        assert len(raw["latency_ms"][mode]) == requests and min(raw["latency_ms"][mode]) > 0
        assert raw[mode]["p50"] <= raw[mode]["p90"] <= raw[mode]["max"]
        # The part outside the actions' main is a part: positive and less than each request's latency.
        assert all(0 < o < t for o, t in zip(raw["outside_ms"][mode], raw["latency_ms"][mode], strict=True))
    assert raw["ratio"]["p50"] == pytest.approx(raw["split"]["p50"] / raw["whole"]["p50"])
    parts = raw["split"]["stats"]
    assert [s["stage"] for s in parts] == list(range(stages))
    assert [r for s in parts for r in range(*s["layers"])] == list(range(layers))  # the stages tile the model
    assert parts[0]["span"][0] == 0.0 and parts[-1]["span"][1] == 1.0
    # Each stage built only its own parts: together exactly the whole's weights.
    assert sum(s["weights_bytes"] for s in parts) == raw["whole"]["stats"]["weights_bytes"]
    assert all(0 < s["weights_bytes"] < raw["whole"]["stats"]["weights_bytes"] for s in parts)
    hops = raw["hops"]
    assert len(hops) == requests * (stages - 1)
    tensor = 2 * 8 * 32 * 4  # batch × seq × d_model float32
    if client:  # plain requests: base64 in JSON
        assert raw["hops_as"] == "JSON" and "tensors between stages as JSON" in text
        assert all(h["tensor_bytes"] == tensor and h["json_bytes"] > tensor * 4 // 3 for h in hops)
    else:  # the invoker's client, as the invoker hands them on: stage frames, the tensor's bytes and a little JSON
        assert raw["hops_as"] == "stage frames" and "a stage frame of" in text
        assert all(h["tensor_bytes"] == tensor and tensor < h["json_bytes"] < tensor * 4 // 3 for h in hops)
    assert raw["gpu_note"] is None  # the CPU: no claim about GPUs
    assert "| whole (1 process) |" in text and f"| split ({stages} stages) |" in text
    assert f"| stage {stages - 1} of {stages} |" in text and "max abs difference" in text
    assert "| split: outside the actions' main (HTTP, runtimes, JSON) |" in text


def test_the_page_is_the_recorded_runs_rendered() -> None:
    """docs/benchmarks/split-pipeline.md holds each recorded H100 run as render() writes it (no hand-edited numbers)."""
    sys.path.insert(0, str(ROOT))
    from bench.split_pipeline import INTRO, render

    page = (ROOT / "docs" / "benchmarks" / "split-pipeline.md").read_text()
    assert page.startswith(INTRO)
    data = ROOT / "docs" / "benchmarks" / "data" / "split-pipeline"
    runs = sorted(data.glob("*.json"))
    assert len(runs) == 11
    for path in runs:
        raw = json.loads(path.read_text())
        assert raw["max_abs_diff"] == 0 and raw["same_next_tokens"] and raw["gpu_note"]
        section = render(raw, "TITLE").split("\n", 1)[1]  # all but the heading
        assert section in page, path.name
