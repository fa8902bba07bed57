"""Running the official ``openwhisk`` npm client's compatibility script (``tests/e2e/npm/compat.js``)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from tests.host_lock import host_lock

NPM_DIR = Path(__file__).resolve().parents[1] / "e2e" / "npm"


async def run_command(*argv: str, cwd: Path, env: dict[str, str] | None = None, timeout_s: float) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=str(cwd), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(errors="replace")


async def install_client() -> None:
    installed = NPM_DIR / "node_modules" / "openwhisk" / "package.json"
    if installed.exists():
        return
    async with contextlib.AsyncExitStack() as stack:
        # The other pytest process of `make test` may be installing it too: one at a time.
        await asyncio.to_thread(stack.enter_context, host_lock("npm-client-install"))
        if installed.exists():
            return
        command = "ci" if (NPM_DIR / "package-lock.json").exists() else "install"
        rc, out = await run_command("npm", command, "--no-audit", "--no-fund", cwd=NPM_DIR, timeout_s=300)
        assert rc == 0, f"npm {command} failed:\n{out}"
