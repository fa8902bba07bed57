#!/usr/bin/env python3
"""Runs the shell and JavaScript examples of README.md and of docs/rest-api.md's quick start, in order,
against a fresh ``dilu-invoker standalone``, and fails on the first error.

    .venv/bin/python scripts/doc_examples.py            # what CI runs
    .venv/bin/python scripts/doc_examples.py --list     # the blocks, with what is done with each

A fenced block's info string decides what happens to it:

* ``sh``/``bash``: run by bash with ``set -euo pipefail``; the blocks of one document share one shell
  session (variables and files carry over), in a scratch copy of the checkout;
* ``js``: run by node from ``examples/npm`` (where its ``node_modules`` are); a JavaScript block must be
  the text of a file under ``examples/`` (the README shows the runnable file, not a variant of it);
* ``sh setup``: the README's two set-up commands; not run here (``.ci/run`` runs the test command, and
  ``scripts/fresh-machine-check.sh`` the install command on a fresh Debian), but the test command must
  be the one ``.ci/run`` runs;
* ``sh wsk``: needs the ``wsk`` CLI; run when ``wsk`` is on PATH (configured by the banner's
  ``wsk property set`` line), otherwise reported as not run;
* anything else (``text``, ``json``, …) is not code.

The server is started from this checkout on the examples' address, 127.0.0.1:3233, with a fresh data
directory, and stopped at the end (its exit status must be 0).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API = "http://127.0.0.1:3233"
#: the documents and, for each, the heading whose section holds its examples ("" = the whole document)
DOCUMENTS: tuple[tuple[str, str], ...] = (("README.md", ""), ("docs/rest-api.md", "## Quick start"))
_FENCE = re.compile(r"^```(\S*)(.*)$")


@dataclass(frozen=True, slots=True)
class Block:
    document: str
    line: int
    lang: str
    tags: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def kind(self) -> str:
        """run-sh, run-js, setup, wsk or none."""
        if self.lang in ("sh", "bash", "shell"):
            if "setup" in self.tags:
                return "setup"
            if "wsk" in self.tags:
                return "wsk"
            return "run-sh"
        if self.lang in ("js", "javascript"):
            return "run-js"
        return "none"


def blocks(document: str, section: str = "") -> list[Block]:
    """The fenced blocks of ``document`` (in ``section`` only, when given: from that heading to the
    next heading of the same or a higher level)."""
    lines = (ROOT / document).read_text().splitlines()
    lo, hi = 0, len(lines)
    if section:
        level = len(section) - len(section.lstrip("#"))
        try:
            lo = next(i for i, line in enumerate(lines) if line.strip() == section)
        except StopIteration:
            raise SystemExit(f"doc_examples: {document} has no section {section!r}") from None
        for i in range(lo + 1, len(lines)):
            stripped = lines[i].lstrip()
            if stripped.startswith("#") and len(stripped) - len(stripped.lstrip("#")) <= level and \
                    not _inside_fence(lines, lo, i):
                hi = i
                break
    out: list[Block] = []
    i = lo
    while i < hi:
        match = _FENCE.match(lines[i])
        if match and match.group(1):
            start = i
            i += 1
            body: list[str] = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append(Block(document, start + 1, match.group(1), tuple(match.group(2).split()),
                             "\n".join(body) + "\n"))
        i += 1
    return out


def _inside_fence(lines: list[str], lo: int, i: int) -> bool:
    return sum(1 for line in lines[lo:i] if line.startswith("```")) % 2 == 1


def all_blocks() -> list[Block]:
    return [b for document, section in DOCUMENTS for b in blocks(document, section)]


def setup_commands() -> list[str]:
    return [b.text.strip() for b in blocks("README.md") if b.kind == "setup"]


def check_static(found: list[Block]) -> list[str]:
    """What can be checked without running anything."""
    problems: list[str] = []
    setup = [b for b in found if b.kind == "setup"]
    if len(setup) != 2:
        problems.append(f"README.md: expected 2 set-up blocks (install+start, tests), found {len(setup)}")
    else:
        ci = (ROOT / ".ci" / "run").read_text()
        if setup[1].text.strip() not in ci.splitlines():
            problems.append(f"{setup[1].where}: .ci/run does not run the README's test command "
                            f"{setup[1].text.strip()!r} as printed")
    examples = {p.read_text(): p for p in (ROOT / "examples").rglob("*.js") if "node_modules" not in p.parts}
    for b in found:
        if b.kind == "run-js" and b.text not in examples:
            problems.append(f"{b.where}: this JavaScript block is not the text of a file under examples/")
    return problems


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds (TIME_WAIT is fine)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_ready(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"doc_examples: the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{API}/api/v1", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"doc_examples: the server did not answer {API}/api/v1 within {timeout_s:.0f} s")


def copy_checkout(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files: what a user's checkout holds."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        src = ROOT / raw.decode()
        if src.is_file():
            target = dest / raw.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def run_document(document: str, found: list[Block], work: Path, timeout_s: float) -> list[str]:
    """Runs one document's blocks in order; returns what was not run, and why."""
    skipped: list[str] = []
    has_wsk = shutil.which("wsk") is not None
    script = ["set -euo pipefail"]
    pending_js: list[tuple[Block, Path]] = []
    for n, b in enumerate(found):
        if b.document != document or b.kind in ("setup", "none"):
            continue
        if b.kind == "wsk" and not has_wsk:
            skipped.append(f"{b.where} (needs the wsk CLI, not installed here)")
            continue
        script.append(f"echo '--- {b.where}' >&2")
        if b.kind == "run-js":
            path = work / "examples" / "npm" / f".doc-block-{n}.js"
            path.write_text(b.text)
            pending_js.append((b, path))
            script.append(f"(cd examples/npm && node {path.name})")
        else:
            script.append(b.text)
    if len(script) == 1:
        return skipped
    print(f"doc_examples: running {document}", file=sys.stderr, flush=True)
    started = time.monotonic()
    result = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, timeout=timeout_s, check=False,
                            env={**os.environ, "NO_COLOR": "1"})
    if result.returncode != 0:
        raise SystemExit(f"doc_examples: {document}: a block failed (exit {result.returncode}); "
                         "the last '---' line above names it")
    print(f"doc_examples: {document} passed in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return skipped


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the blocks and what is done with each")
    parser.add_argument("--setup-command", type=int, metavar="N",
                        help="print the README's N-th set-up command (1: install and start, 2: tests)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound of each document's run")
    args = parser.parse_args(argv)
    found = all_blocks()
    if args.setup_command:
        print(setup_commands()[args.setup_command - 1])
        return 0
    if args.list:
        for b in found:
            print(f"{b.kind:<7} {b.where} ({b.lang}{' ' + ' '.join(b.tags) if b.tags else ''})")
        return 0
    problems = check_static(found)
    if problems:
        for p in problems:
            print(f"doc_examples: {p}", file=sys.stderr)
        return 1
    if not _port_free(3233):
        print("doc_examples: 127.0.0.1:3233 is in use; the examples need it", file=sys.stderr)
        return 1
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dilu-doc-examples-") as tmp:
        work = Path(tmp) / "checkout"
        copy_checkout(work)
        data = Path(tmp) / "data"
        log_path = Path(tmp) / "standalone.log"
        with open(log_path, "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir", str(data)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(ROOT), "DILU_LOG_JSON": "true"})
        try:
            _wait_ready(server, 60)
            for document, _ in DOCUMENTS:
                skipped += run_document(document, found, work, args.timeout_s)
        except BaseException:
            print(f"doc_examples: server log (last 40 lines of {log_path}):", file=sys.stderr)
            print("\n".join(log_path.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
            raise
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        if server.returncode != 0:
            print(f"doc_examples: the server exited with {server.returncode}", file=sys.stderr)
            return 1
    ran = sum(1 for b in found if b.kind in ("run-sh", "run-js")) + (
        sum(1 for b in found if b.kind == "wsk") - len(skipped))
    print(f"doc_examples: {ran} blocks ran, {len(skipped)} not run", file=sys.stderr)
    for s in skipped:
        print(f"doc_examples: not run: {s}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
