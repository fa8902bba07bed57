"""``dilu-invoker`` command line: one subcommand per mode of running."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from dilu_invoker import __version__, config

#: subcommand -> (module:function taking (argv) or (Config, Namespace), config sections it uses, help)
_COMMANDS: dict[str, tuple[str, Sequence[str] | None, str]] = {
    "standalone": ("dilu_invoker.standalone:main", None,
                   "REST API + invoker(s) + balancer + embedded Redis on one machine"),
    "invoker": ("dilu_invoker.openwhisk.invoker_main:main",
                ("log", "invoker", "redis", "gpu", "kafka", "couchdb", "balancer"),
                "an OpenWhisk invoker speaking Kafka and CouchDB"),
    "balancer": ("dilu_invoker.loadbalancer.service:main", ("log", "redis", "gpu", "balancer"),
                 "the cluster balancer (placement, horizontal scaling, routing tables)"),
}

#: subcommands that parse their own arguments (they ship with their own small CLIs)
_RAW_COMMANDS: dict[str, tuple[str, str]] = {
    "runtime": ("dilu_invoker.actions.runtime:main", "the OpenWhisk action runtime (/init, /run)"),
    "simulate": ("dilu_invoker.sim.cli:main", "trace-driven simulation of the placement and serving policies"),
    "profile": ("dilu_invoker.sim.profiler:main", "measure latency/throughput over SM share x batch size"),
}


def _resolve(target: str) -> Callable[..., int]:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dilu-invoker", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dilu-invoker {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, sections, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        config.add_arguments(p, sections=sections)
    for name, (_, help_text) in _RAW_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _RAW_COMMANDS:
        return int(_resolve(_RAW_COMMANDS[argv[0]][0])(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        cfg = config.load(args)
    except config.ConfigError as exc:
        parser.error(str(exc))
    return int(_resolve(_COMMANDS[args.command][0])(cfg, args) or 0)
