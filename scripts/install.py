#!/usr/bin/env python3
"""Install dilu-invoker from this checkout into its own virtual environment, for any user, with the
system Python (PEP 668 forbids installing into it) — and without Debian's python3-venv package.

    python3 scripts/install.py            # then: ~/.local/bin/dilu-invoker standalone

* The environment is ``$DILU_VENV`` or ``~/.local/share/dilu-invoker/venv``; ``~/.local/bin/dilu-invoker``
  links to its command (``$DILU_BIN_DIR`` to link elsewhere).
* Where ``ensurepip`` is missing (Debian and Ubuntu ship it in python3-venv), the environment is made
  without pip and pip is added from its wheel on PyPI, checked against the digest PyPI publishes.
* Extras: ``python3 scripts/install.py sim`` (or ``sim,gpu``) installs ``.[sim]``.

Standard library only: it runs before anything is installed. Running it again upgrades in place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPI_PIP = "https://pypi.org/pypi/pip/json"


def say(message: str) -> None:
    print(f"install: {message}", file=sys.stderr, flush=True)


def fail(message: str) -> None:
    print(f"install: error: {message}", file=sys.stderr)
    sys.exit(1)


def has_ensurepip() -> bool:
    spec = importlib.util.find_spec("ensurepip")
    if spec is None or spec.origin is None:
        return False
    # Debian keeps the module but not the wheels it installs from
    return bool(list((Path(spec.origin).parent / "_bundled").glob("pip-*.whl")))


def bootstrap_pip(python: Path) -> None:
    """pip into an environment made without it: pip's wheel from PyPI, run from the wheel itself."""
    say("ensurepip is not available here: installing pip from its wheel on PyPI")
    with urllib.request.urlopen(PYPI_PIP, timeout=60) as resp:
        release = json.load(resp)
    wheel = next(u for u in release["urls"] if u["packagetype"] == "bdist_wheel")
    # a mirror may answer with URLs relative to the JSON document
    with urllib.request.urlopen(urllib.parse.urljoin(PYPI_PIP, wheel["url"]), timeout=120) as resp:
        data = resp.read()
    if hashlib.sha256(data).hexdigest() != wheel["digests"]["sha256"]:
        fail(f"{wheel['filename']}: sha256 does not match PyPI's")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / wheel["filename"]
        path.write_bytes(data)
        subprocess.run([str(python), f"{path}/pip", "install", "-q", "--no-index", str(path)], check=True)


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 - this runs under whatever python3 the machine has
        fail(f"dilu-invoker needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    extras = argv[0] if argv else ""
    home = Path.home()
    env_dir = Path(os.environ.get("DILU_VENV") or home / ".local" / "share" / "dilu-invoker" / "venv")
    bin_dir = Path(os.environ.get("DILU_BIN_DIR") or home / ".local" / "bin")
    python = env_dir / "bin" / "python"
    pip_ready = python.exists() and subprocess.run([str(python), "-m", "pip", "--version"],
                                                   capture_output=True, check=False).returncode == 0
    if not pip_ready:
        with_pip = has_ensurepip()
        say(f"creating the environment {env_dir}")
        venv.EnvBuilder(with_pip=with_pip, clear=python.exists(), symlinks=True).create(env_dir)
        if not with_pip:
            bootstrap_pip(python)
    target = f"{ROOT}[{extras}]" if extras else str(ROOT)
    say(f"pip install {target}")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", target], check=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    link = bin_dir / "dilu-invoker"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(env_dir / "bin" / "dilu-invoker")
    say(f"installed: {link} (start it with: {link} standalone)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as exc:
        fail(f"{' '.join(map(str, exc.cmd))} exited with {exc.returncode}")
    except (OSError, ValueError, KeyError, StopIteration) as exc:
        fail(f"{type(exc).__name__}: {exc}")
