#!/usr/bin/env python3
"""``make test``: the whole suite as two pytest processes side by side, or plain pytest on what is given.

    .venv/bin/python scripts/run_tests.py              # the suite, in two lanes (what `make test` runs)
    .venv/bin/python scripts/run_tests.py tests/x.py   # plain pytest on those arguments (`make test TESTS=…`)

Most of the suite's wall time goes to a few tests that mostly wait: the Ansible converge, the soak, the
product, vertical and shim bench dry runs, a cluster compaction, the container tests (measured with
``--durations``, which each lane prints). They run in the lane ``waiting`` (the files in
WAITING, by pytest's own paths); every other file runs in the lane ``rest`` (the same paths as
``--ignore``), so a new test file lands in ``rest`` without a change here. Every test that talks to
podman is in ``waiting``: a docker-backend invoker removes the ``wsk{id}_`` containers it finds at start,
whoever made them. What the two lanes may still share is made safe where it is set up: the runtime
image build and the npm installs take a file lock (tests/host_lock.py), ports are free
ones, uids are leased host-wide.

Each lane's output goes to a file and is printed whole once that lane ends, then one closing line sums
both (``make-test: N passed, N failed``). The exit status is non-zero when either lane fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the lane of the long, mostly waiting tests (and of everything that uses podman): about as long as the rest
WAITING = (
    "tests/ansible/test_ansible.py",
    "tests/invoker/test_soak.py",
    "tests/gpu/test_product_bench.py",
    "tests/gpu/test_vertical_bench.py",
    "tests/gpu/test_product_matrix.py",
    "tests/cuda_shim/test_shim_bench.py",
    "tests/loadbalancer/test_compaction_cluster.py",
    "tests/invoker/test_isolation.py",
    "tests/invoker/test_docker_backend.py",
    "tests/actions/test_image.py",
    "tests/test_cli.py",
)
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|rerun)\b")


@dataclass
class Lane:
    name: str
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    took_s: float = 0.0

    def start(self, pytest: list[str]) -> None:
        self.started = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([*pytest, *self.args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def counts(self) -> dict[str, int]:
        """What pytest's closing line (``12 passed, 1 skipped in 3.04s``) counts."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        return {("errors" if kind.startswith("error") else kind): int(n) for n, kind in COUNTS.findall(last)}


def lanes(log_dir: Path) -> list[Lane]:
    missing = [path for path in WAITING if not (ROOT / path).is_file()]
    if missing:
        raise SystemExit(f"run_tests.py: WAITING names files that are not there: {missing}")
    return [Lane("waiting", list(WAITING), log_dir / "waiting.log"),
            Lane("rest", ["tests", *(f"--ignore={path}" for path in WAITING)], log_dir / "rest.log")]


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q"]
    if argv:
        return subprocess.call([*pytest, *argv], cwd=ROOT)
    log_dir = Path(tempfile.mkdtemp(prefix="dilu-tests-"))
    todo = lanes(log_dir)
    for lane in todo:
        lane.start([*pytest, "--durations=15"])  # what to move when the lanes drift apart
    print(f"make test: lanes {', '.join(lane.name for lane in todo)} running side by side (logs in {log_dir})",
          flush=True)
    rcs: dict[str, int] = {}
    try:
        pending = list(todo)
        while pending:
            for lane in list(pending):
                assert lane.proc is not None
                rc = lane.proc.poll()
                if rc is None:
                    continue
                lane.took_s = time.monotonic() - lane.started
                rcs[lane.name] = rc
                pending.remove(lane)
                print(f"\n===== lane {lane.name}: pytest {' '.join(lane.args[:3])}{' …' if len(lane.args) > 3 else ''}"
                      f" (exit {rc}, {lane.took_s:.0f} s)", flush=True)
                sys.stdout.write(lane.log.read_text(errors="replace"))
                sys.stdout.flush()
            time.sleep(0.5)
    except KeyboardInterrupt:
        for lane in todo:
            if lane.proc is not None and lane.proc.poll() is None:
                lane.proc.terminate()
                lane.proc.wait()
        raise
    total: dict[str, int] = {}
    print("\n===== summary", flush=True)
    for lane in todo:
        counts = lane.counts()
        for kind, n in counts.items():
            total[kind] = total.get(kind, 0) + n
        shown = ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "no closing line"
        print(f"lane {lane.name}: exit {rcs[lane.name]}, {lane.took_s:.0f} s: {shown}")
    failed = total.get("failed", 0) + total.get("errors", 0)
    print(f"make-test: {total.get('passed', 0)} passed, {failed} failed, {total.get('skipped', 0)} skipped")
    return next((rc for rc in rcs.values() if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
