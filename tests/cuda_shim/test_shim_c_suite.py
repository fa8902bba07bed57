"""Build the shim and run its C tests against the fake driver, plus checks on the built library."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from shim_testlib import SHIM_DIR, ShimBuild

# The C tests, in the order shim_tests --list prints them.
C_TESTS = (
    "gpa",
    "dlsym",
    "lcuda",
    "passthrough",
    "bad_control",
    "rate",
    "quota_change",
    "memcap",
    "meminfo",
    "stats",
    "stale",
    "threads64",
    "fork",
    "capture",
    "inflight",
    "devices",
    "spans",
)


def _run(
    build: ShimBuild, *args: str, preload: bool
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(build.tests), *args],
        env=build.env(preload=preload),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _hooked_names() -> list[str]:
    text = (SHIM_DIR / "src" / "hooks.h").read_text()
    block = text[
        text.index("#define DILU_HOOKS(X)") : text.index("#define DILU_USES(X)")
    ]
    return re.findall(r"X\((\w+),", block)


def test_c_test_list_matches(shim_build: ShimBuild) -> None:
    out = _run(shim_build, "--list", preload=False)
    assert out.returncode == 0, out.stderr
    assert tuple(out.stdout.split()) == C_TESTS


@pytest.mark.parametrize("name", C_TESTS)
def test_c_test_passes_with_the_shim(shim_build: ShimBuild, name: str) -> None:
    out = _run(shim_build, name, preload=True)
    assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr}"
    assert f"{name}: ok" in out.stdout


def test_every_c_test_fails_without_the_shim(shim_build: ShimBuild) -> None:
    """Negative control: each test detects that the shim is missing."""
    passed_anyway = [
        name
        for name in C_TESTS
        if _run(shim_build, name, preload=False).returncode == 0
    ]
    assert passed_anyway == []


def test_c_tests_cover_every_hook(shim_build: ShimBuild) -> None:
    out = _run(shim_build, "--list-hooks", preload=False)
    assert out.returncode == 0, out.stderr
    hooked = _hooked_names()
    assert len(hooked) == len(set(hooked)) > 30
    assert sorted(out.stdout.split()) == sorted(hooked)


def _dynamic_symbols(build: ShimBuild) -> list[list[str]]:
    out = subprocess.run(
        ["objdump", "-T", str(build.library)],
        capture_output=True,
        text=True,
        check=True,
    )
    return [
        line.split()
        for line in out.stdout.splitlines()
        if re.match(r"^[0-9a-f]{16} ", line)
    ]


def test_exports_are_exactly_the_hooks(shim_build: ShimBuild) -> None:
    """-fvisibility=hidden: nothing but the wrappers, dlsym and the query function leaks out."""
    defined = {cols[-1] for cols in _dynamic_symbols(shim_build) if "*UND*" not in cols}
    defined = {name for name in defined if not name.startswith("_")}
    assert defined == set(_hooked_names()) | {"dlsym", "dilu_shim_query"}


def test_loads_on_glibc_2_17(shim_build: ShimBuild) -> None:
    """No import may need a glibc newer than 2.17 (containers with older glibc than the builder)."""
    versions = set()
    for cols in _dynamic_symbols(shim_build):
        for col in cols:
            m = re.fullmatch(r"\(?GLIBC_(\d+)\.(\d+)(?:\.\d+)?\)?", col)
            if m:
                versions.add((int(m.group(1)), int(m.group(2))))
    assert versions, "no versioned glibc imports found: objdump output changed?"
    too_new = sorted(v for v in versions if v > (2, 17))
    assert too_new == []
    needed = subprocess.run(
        ["readelf", "-d", str(shim_build.library)],
        capture_output=True,
        text=True,
        check=True,
    )
    # where pre-2.34 glibc keeps dlvsym and pthread_create
    assert "libdl.so.2" in needed.stdout and "libpthread.so.0" in needed.stdout


def test_make_test_target(shim_build: ShimBuild) -> None:
    """The documented `make -C cuda_shim test` runs the suite and the negative control."""
    out = subprocess.run(
        ["make", "-C", str(SHIM_DIR), "test"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all C tests passed; all failed without the shim" in out.stdout


NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
)
# Driver entry points of the families the shim meters, as cuGetProcAddress base names.
METERED_FAMILY = re.compile(
    r"^cu(Launch|GraphLaunch|GraphInstantiate|GraphExec(Update|Destroy)|Mem(Alloc|Free|Create|Release|GetInfo))"
)
# Host-side members of those families: nothing to meter.
HOST_SIDE = {"cuLaunchHostFunc", "cuMemAllocHost", "cuMemFreeHost", "cuMemHostAlloc"}


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_cudart_requests_nothing_the_shim_misses(
    shim_build: ShimBuild, tmp_path: Path
) -> None:
    """The real CUDA runtime's lookups, recorded through the shim: every launch- or
    memory-family entry point it asks for must be one the shim wraps, so a new name in a
    future CUDA fails here instead of escaping the quota silently."""
    src, exe = tmp_path / "app.cu", tmp_path / "app"
    src.write_text(
        "__global__ void k() {}\nint main() { k<<<1, 1>>>(); return (int)cudaDeviceSynchronize(); }\n"
    )
    assert NVCC is not None
    cc = subprocess.run(
        [NVCC, "-o", str(exe), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert cc.returncode == 0, cc.stderr
    env = shim_build.env(preload=True, extra={"DILU_SHIM_LOG_LEVEL": "5"})
    run = subprocess.run(
        [str(exe)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    # The fake driver cannot run cudart's kernels; the lookups are what we want.
    requested = set(re.findall(r"cuGetProcAddress_v2\((cu\w+), \d+, \d+\)", run.stderr))
    assert len(requested) > 200, run.stderr[-2000:]
    hooked_bases = set(
        re.findall(r'"(cu\w+)"\)', (SHIM_DIR / "src" / "hooks.h").read_text())
    )
    family = {name for name in requested if METERED_FAMILY.match(name)} - HOST_SIDE
    assert family, "no launch/memory lookups recorded"
    assert sorted(family - hooked_bases) == []
