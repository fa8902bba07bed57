"""Where libdilu_shim.so is, and what a GPU container needs to run under it.

The invoker gives every GPU container the shim library, its instance's control block
(read-only) and stats block (read-write), and three environment variables:

* ``LD_PRELOAD``: the library inside the container;
* ``DILU_SHIM_CONTROL`` and ``DILU_SHIM_STATS``: the two blocks inside the container;
* optionally ``DILU_SHIM_LOG_LEVEL`` (0 off .. 5 trace; read once by the shim).

Stdlib-only, like :mod:`dilu_invoker.gpu.abi`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

LIBRARY_NAME = "libdilu_shim.so"
ENV_LIBRARY = "DILU_SHIM_LIBRARY"
ENV_CONTROL = "DILU_SHIM_CONTROL"
ENV_STATS = "DILU_SHIM_STATS"
ENV_LOG_LEVEL = "DILU_SHIM_LOG_LEVEL"
ENV_REAL_LIBCUDA = "DILU_SHIM_REAL_LIBCUDA"
CONTAINER_DIR = "/run/dilu-shim"

_PACKAGE_LIBRARY = Path(__file__).resolve().parent / "lib" / LIBRARY_NAME
_SOURCE_TREE_LIBRARY = (
    Path(__file__).resolve().parents[2] / "cuda_shim" / "build" / LIBRARY_NAME
)


class ShimNotFoundError(FileNotFoundError):
    """No built libdilu_shim.so where the invoker looks for it."""


def library_candidates(*, environ: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    """Places searched, in order: ``$DILU_SHIM_LIBRARY``, the package, the source tree."""
    env = os.environ if environ is None else environ
    override = env.get(ENV_LIBRARY)
    if override:
        # An explicit choice is never silently replaced by another build.
        return (Path(override),)
    return (_PACKAGE_LIBRARY, _SOURCE_TREE_LIBRARY)


def find_library(*, environ: Mapping[str, str] | None = None) -> Path:
    """The shim library to mount into GPU containers."""
    candidates = library_candidates(environ=environ)
    for path in candidates:
        if path.is_file():
            return path.resolve()
    tried = ", ".join(str(p) for p in candidates)
    raise ShimNotFoundError(
        f"{LIBRARY_NAME} not found (tried {tried}); build it with `make -C cuda_shim` or set {ENV_LIBRARY}"
    )


@dataclass(frozen=True, slots=True)
class Mount:
    """A host file bind-mounted into the container."""

    source: Path
    target: str
    read_only: bool


@dataclass(frozen=True, slots=True)
class ShimContainerConfig:
    """Environment and mounts that put one container under the shim."""

    env: Mapping[str, str]
    mounts: tuple[Mount, ...]


def _check_log_level(log_level: int | None) -> None:
    if log_level is not None and not 0 <= log_level <= 5:
        raise ValueError(f"log_level must be within 0..5, got {log_level!r}")


def container_config(
    *,
    control_path: Path | str,
    stats_path: Path | str,
    library: Path | str | None = None,
    container_dir: str = CONTAINER_DIR,
    log_level: int | None = None,
) -> ShimContainerConfig:
    """What a container backend must add for one GPU instance.

    The control block is mounted read-only, so nothing inside the container can
    change its own quota. Mount files individually: the shim and the manager share
    them through ``mmap``, so the host paths must stay the same inodes for the
    container's lifetime.
    """
    _check_log_level(log_level)
    if not container_dir.startswith("/"):
        raise ValueError(f"container_dir must be absolute, got {container_dir!r}")
    lib = Path(library) if library is not None else find_library()
    base = container_dir.rstrip("/")
    lib_in, ctl_in, st_in = f"{base}/{LIBRARY_NAME}", f"{base}/control", f"{base}/stats"
    env = {"LD_PRELOAD": lib_in, ENV_CONTROL: ctl_in, ENV_STATS: st_in}
    if log_level is not None:
        env[ENV_LOG_LEVEL] = str(log_level)
    mounts = (
        Mount(source=lib, target=lib_in, read_only=True),
        Mount(source=Path(control_path), target=ctl_in, read_only=True),
        Mount(source=Path(stats_path), target=st_in, read_only=False),
    )
    return ShimContainerConfig(env=env, mounts=mounts)


def process_env(
    *,
    control_path: Path | str,
    stats_path: Path | str,
    library: Path | str | None = None,
    log_level: int | None = None,
    base_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a GPU action run as a plain host process (no container).

    The shim goes first in ``LD_PRELOAD``; anything already preloaded stays after it.
    """
    _check_log_level(log_level)
    lib = Path(library) if library is not None else find_library()
    env = dict(os.environ if base_env is None else base_env)
    others = [
        p
        for p in env.get("LD_PRELOAD", "").replace(":", " ").split()
        if Path(p).name != LIBRARY_NAME
    ]
    env["LD_PRELOAD"] = " ".join([str(lib), *others])
    env[ENV_CONTROL] = str(control_path)
    env[ENV_STATS] = str(stats_path)
    if log_level is not None:
        env[ENV_LOG_LEVEL] = str(log_level)
    return env
