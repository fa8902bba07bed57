"""Build hook: put libdilu_shim.so into the package where a C compiler and cuda.h exist.

All metadata lives in setup.cfg. `pip install .` runs `make -C cuda_shim` and ships the
library as dilu_invoker/gpu/lib/libdilu_shim.so, where dilu_invoker.gpu.shim looks
first. Without gcc or the CUDA headers the install still succeeds, without the library
(the invoker then reports where it looked); `make -C cuda_shim` can build it later.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "cuda_shim"
LIBRARY = "libdilu_shim.so"


def build_shim() -> Path | None:
    if not (SHIM_DIR / "Makefile").exists() or shutil.which("make") is None:
        return None
    result = subprocess.run(
        ["make", "-C", str(SHIM_DIR)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        print(
            f"warning: {LIBRARY} not built (make -C cuda_shim failed):\n{result.stderr[-2000:]}",
            file=sys.stderr,
        )
        return None
    built = SHIM_DIR / "build" / LIBRARY
    return built if built.is_file() else None


class BuildPyWithShim(build_py):
    def run(self) -> None:
        super().run()
        built = build_shim()
        if built is not None:
            target = Path(self.build_lib) / "dilu_invoker" / "gpu" / "lib"
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, target / LIBRARY)


class ShimDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        # The wheel carries a native library: tag it for this platform.
        return (SHIM_DIR / "Makefile").exists()


setup(cmdclass={"build_py": BuildPyWithShim}, distclass=ShimDistribution)
