"""Shared helpers of the shim tests (a uniquely named module, importable from test files)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = REPO / "cuda_shim"


@dataclass(frozen=True, slots=True)
class ShimBuild:
    build: Path
    library: Path
    fake_dir: Path
    tests: Path
    launch_loop: Path

    def env(
        self, *, preload: bool, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Environment for a test program: the fake driver, the shim if asked, nothing inherited from DILU_*."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DILU_SHIM_", "FAKE_CUDA_", "LD_PRELOAD"))
        }
        env["LD_LIBRARY_PATH"] = str(self.fake_dir)
        if preload:
            env["LD_PRELOAD"] = str(self.library)
        env.update(extra or {})
        return env
