"""``dilu-invoker invoker`` as a child process, with the runner double in place of the invoker core.

Command line and environment are read exactly as ``dilu-invoker invoker`` reads them (same parser,
same configuration loader, same signal handling and wiring); only the runner differs. Usage:
``python tests/openwhisk/invoker_child.py --id 5 [more invoker flags]``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from doubles import ScriptedRunner

from dilu_invoker import cli, config, logs
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.openwhisk.invoker_main import serve, stop_on_signals


async def _main(cfg: config.Config) -> int:
    manifest = Manifest.load(cfg.invoker.runtimes_manifest)
    await serve(cfg, runner=ScriptedRunner(), manifest=manifest, stop=stop_on_signals())
    return 0


def main(argv: list[str]) -> int:
    args = cli.build_parser().parse_args(["invoker", *argv])
    cfg = config.load(args)
    logs.configure(cfg.log)
    return asyncio.run(_main(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
