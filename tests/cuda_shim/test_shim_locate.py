"""Finding libdilu_shim.so and the container wiring the invoker gets from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dilu_invoker.gpu import shim


def test_override_wins_and_must_exist(tmp_path: Path) -> None:
    lib = tmp_path / "libdilu_shim.so"
    lib.write_bytes(b"\x7fELF")
    assert shim.find_library(environ={shim.ENV_LIBRARY: str(lib)}) == lib.resolve()
    with pytest.raises(shim.ShimNotFoundError, match="DILU_SHIM_LIBRARY"):
        shim.find_library(environ={shim.ENV_LIBRARY: str(tmp_path / "missing.so")})


def test_search_order_is_package_then_source_tree() -> None:
    package, source = shim.library_candidates(environ={})
    assert package.parts[-3:] == ("gpu", "lib", "libdilu_shim.so")
    assert source.parts[-3:] == ("cuda_shim", "build", "libdilu_shim.so")


def test_container_config(tmp_path: Path) -> None:
    lib = tmp_path / "libdilu_shim.so"
    cfg = shim.container_config(
        control_path=tmp_path / "control",
        stats_path=tmp_path / "stats",
        library=lib,
        log_level=2,
    )
    assert dict(cfg.env) == {
        "LD_PRELOAD": "/run/dilu-shim/libdilu_shim.so",
        "DILU_SHIM_CONTROL": "/run/dilu-shim/control",
        "DILU_SHIM_STATS": "/run/dilu-shim/stats",
        "DILU_SHIM_LOG_LEVEL": "2",
    }
    assert cfg.mounts == (
        shim.Mount(source=lib, target="/run/dilu-shim/libdilu_shim.so", read_only=True),
        shim.Mount(
            source=tmp_path / "control", target="/run/dilu-shim/control", read_only=True
        ),
        shim.Mount(
            source=tmp_path / "stats", target="/run/dilu-shim/stats", read_only=False
        ),
    )


@pytest.mark.parametrize(
    "kwargs",
    [{"log_level": 9}, {"log_level": -1}, {"container_dir": "relative/dir"}],
    ids=["level-too-high", "level-negative", "relative-dir"],
)
def test_container_config_rejects_bad_options(
    tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError):
        shim.container_config(
            control_path="c", stats_path="s", library=tmp_path / "l.so", **kwargs
        )


def test_process_env_puts_the_shim_first_once(tmp_path: Path) -> None:
    lib = tmp_path / "libdilu_shim.so"
    base = {"PATH": "/bin", "LD_PRELOAD": "/opt/other.so:/old/libdilu_shim.so"}
    env = shim.process_env(
        control_path="/c", stats_path="/s", library=lib, base_env=base
    )
    assert env["LD_PRELOAD"] == f"{lib} /opt/other.so"
    assert (
        env["DILU_SHIM_CONTROL"] == "/c"
        and env["DILU_SHIM_STATS"] == "/s"
        and env["PATH"] == "/bin"
    )
    assert "DILU_SHIM_LOG_LEVEL" not in env


def test_package_build_ships_the_library(tmp_path: Path) -> None:
    """setup.py's build_py hook puts the built shim where find_library looks first."""
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    shipped = tmp_path / "dilu_invoker" / "gpu" / "lib" / shim.LIBRARY_NAME
    assert shipped.is_file() and shipped.read_bytes()[:4] == b"\x7fELF"
