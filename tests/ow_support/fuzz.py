"""Schemathesis against a running standalone: the command line and the tally of what it sent.

``tests/e2e/test_api_fuzz.py`` runs it small in CI; ``bench/api_fuzz.py`` runs it at ≥ 10,000 requests.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ow_support.faults import GUEST

CONFIG = Path(__file__).resolve().parents[1] / "e2e" / "schemathesis.toml"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@dataclass(frozen=True, slots=True)
class FuzzResult:
    returncode: int
    statuses: Counter[int]
    output: str

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())


def schemathesis_command() -> list[str]:
    exe = Path(sys.executable).with_name("schemathesis")
    return [str(exe)] if exe.exists() else [shutil.which("schemathesis") or "schemathesis"]


def _statuses(ndjson: Path) -> Counter[int]:
    counts: Counter[int] = Counter()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "status_code" in value and "elapsed" in value:
                counts[int(value["status_code"])] += 1
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for line in ndjson.read_text().splitlines():
        walk(json.loads(line))
    return counts


async def fuzz(url: str, workdir: Path, *, max_examples: int, seed: int = 1, timeout_s: float = 600) -> FuzzResult:
    """Every operation of ``url``'s OpenAPI document, every phase (examples, coverage, fuzzing, stateful)."""
    report = workdir / "schemathesis.ndjson"
    proc = await asyncio.create_subprocess_exec(
        *schemathesis_command(), "--config-file", str(CONFIG), "run", f"{url}/api/v1/api-docs", "--url", url,
        "--auth", ":".join(GUEST), "--checks", CHECKS, "--max-examples", str(max_examples), "--seed", str(seed),
        "--request-timeout", "30", "--report", "ndjson", "--report-ndjson-path", str(report),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=str(workdir))
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return FuzzResult(proc.returncode or 0, _statuses(report) if report.exists() else Counter(),
                      out.decode(errors="replace"))
