"""``dilu-invoker`` command line: one subcommand per mode of running."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from dilu_invoker import __version__, config


class CommandError(Exception):
    """A mistake of the user's (a flag, a file, a missing extra): printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line on stderr (argparse prints the usage block too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: section -> title of its group in ``--help``
_GROUP_TITLES: dict[str, str] = {
    "": "general",
    "standalone": "general",
    "api": "API (OpenWhisk REST)",
    "invoker": "invoker",
    "gpu": "GPU",
    "redis": "Redis",
    "log": "logging",
    "balancer": "balancer",
    "kafka": "Kafka (cluster mode)",
    "couchdb": "CouchDB (cluster mode)",
}

#: the settings ``standalone --help`` shows (``section.name``); ``--help-all`` lists every other one
STANDALONE_ESSENTIALS: frozenset[str] = frozenset({
    "data_dir", "standalone.invokers",
    "api.host", "api.port", "api.auth_file", "api.guest_key",
    "invoker.backend", "invoker.user_memory_mb", "invoker.docker_url", "invoker.preload",
    "gpu.enabled", "gpu.shim_path",
    "redis.url", "redis.server_binary",
    "log.level", "log.json",
})

#: extra spellings, as OpenWhisk's standalone server takes them (``-p/--port``)
_ALIASES: dict[str, tuple[str, ...]] = {"api.port": ("-p", "--port")}

_STANDALONE_SECTIONS = ("log", "api", "invoker", "redis", "gpu", "balancer", "standalone")

#: subcommand -> (module:function taking (Config, Namespace), config sections it uses, help)
_COMMANDS: dict[str, tuple[str, Sequence[str], str]] = {
    "standalone": ("dilu_invoker.standalone:main", _STANDALONE_SECTIONS,
                   "REST API + invoker(s) + balancer + embedded Redis on one machine"),
    "invoker": ("dilu_invoker.openwhisk.invoker_main:main",
                ("log", "invoker", "redis", "gpu", "kafka", "couchdb", "balancer"),
                "an OpenWhisk invoker speaking Kafka and CouchDB"),
    "balancer": ("dilu_invoker.cli:balancer_main", ("log", "redis", "gpu", "balancer", "couchdb"),
                 "the cluster balancer (placement, horizontal scaling, routing tables)"),
    "doctor": ("dilu_invoker.doctor:main", ("log", "api", "invoker", "redis", "gpu"),
               "check this machine: GPUs/NVML, the CUDA shim, MPS, Redis, Docker; each missing piece with its fix"),
}

#: subcommands that parse their own arguments (they ship with their own small CLIs)
_RAW_COMMANDS: dict[str, tuple[str, str]] = {
    "runtime": ("dilu_invoker.actions.runtime:main", "the OpenWhisk action runtime (/init, /run)"),
    "simulate": ("dilu_invoker.sim.cli:main", "trace-driven simulation of the placement and serving policies"),
    "profile": ("dilu_invoker.sim.profiler:main", "measure latency/throughput over SM share x batch size"),
}

#: subcommand -> (extra, modules it needs that the core install does not bring)
_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "simulate": ("sim", ("numpy", "matplotlib")),
    "profile": ("sim", ("numpy",)),
}


def balancer_main(cfg: config.Config, args: argparse.Namespace | None = None) -> int:
    """``dilu-invoker balancer``, with the whisks database's changes feed when CouchDB is configured (model
    pre-loading of actions the controller creates or updates; ``--no-balancer-model-preload`` turns it off)."""
    from dilu_invoker.loadbalancer import service

    feed = None
    if cfg.balancer.model_preload and cfg.couchdb.host:
        from dilu_invoker.invoker.manifest import ManifestError
        from dilu_invoker.openwhisk.changes import WhiskChanges

        try:
            feed = WhiskChanges.from_config(cfg).follow
        except (ManifestError, ValueError) as exc:  # the runtimes manifest, --invoker-gpu-images
            raise config.ConfigError(f"model pre-loading (--balancer-model-preload): {exc}") from exc
    return service.main(cfg, args, action_feed=feed)


def _resolve(target: str) -> Callable[..., int]:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def install_source() -> str:
    """What ``pip install`` should name to add an extra: the directory this was installed from when pip
    recorded one (PEP 610 ``direct_url.json``), else the distribution's name."""
    try:
        text = importlib.metadata.distribution("dilu-invoker").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        text = None
    if text:
        url = str(json.loads(text).get("url", ""))
        if url.startswith("file://"):
            return url[len("file://"):]
    return "dilu-invoker"


def missing_extra(command: str) -> str | None:
    """The one-line message for a command whose extra is not installed, or None."""
    extra, modules = _EXTRAS.get(command, ("", ()))
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    return (f"dilu-invoker {command} needs the [{extra}] extra ({', '.join(absent)} not installed): "
            f"{sys.executable} -m pip install '{install_source()}[{extra}]'")


def _add_settings(parser: argparse.ArgumentParser, sections: Sequence[str], *, essentials: frozenset[str] | None,
                  show_all: bool) -> None:
    """The flags of ``sections`` in one group per section; with ``essentials``, only those are shown
    unless ``show_all`` (the others are accepted all the same)."""
    groups: dict[str, Any] = {}
    for section, title in _GROUP_TITLES.items():  # in this order
        if (not section or section in sections) and title not in groups:
            groups[title] = parser.add_argument_group(title)
    for s in config.settings():
        if s.section and s.section not in sections:
            continue
        key = f"{s.section}.{s.name}" if s.section else s.name
        title = _GROUP_TITLES.get(s.section, s.section)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        kwargs = config.argument_kwargs(s)
        if essentials is not None and not show_all and key not in essentials:
            kwargs["help"] = argparse.SUPPRESS
        groups[title].add_argument(*_ALIASES.get(key, ()), s.flag, **kwargs)
    config.add_removed_arguments(parser, sections=sections)


def build_parser(*, show_all: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(prog="dilu-invoker", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dilu-invoker {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (_, sections, help_text) in _COMMANDS.items():
        essentials = STANDALONE_ESSENTIALS if name == "standalone" else None
        epilog = ("Only the flags most set-ups need are listed; --help-all lists every flag."
                  if essentials is not None and not show_all else None)
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                           usage=f"dilu-invoker {name} [options]")
        if essentials is not None:
            p.add_argument("--help-all", action="store_true", help="list every flag, then exit")
        _add_settings(p, sections, essentials=essentials, show_all=show_all)
    for name, (_, help_text) in _RAW_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean a mistake of the user's, never a fault of the program."""
    from dilu_invoker.openwhisk.rest_auth import AuthFileError
    from dilu_invoker.redis_embedded import EmbeddedRedisError

    return (CommandError, config.ConfigError, AuthFileError, EmbeddedRedisError)


def _check_ports(cfg: config.Config) -> None:
    for flag, port in (("--api-port", cfg.api.port), ("--invoker-port", cfg.invoker.port)):
        if not 0 <= port <= 65535:
            raise CommandError(f"{flag} {port} is not a port (0 to 65535)")


def _check_service(cfg: config.Config) -> None:
    """What every long-running command can find wrong before it starts: ports and a given Redis."""
    from dilu_invoker import doctor

    _check_ports(cfg)
    if cfg.redis.url:
        redis = doctor.check_redis(cfg)
        if redis.status == doctor.ERROR:
            raise CommandError(redis.detail)


def _check_standalone(cfg: config.Config) -> None:
    """And for standalone: the API keys, the Docker engine of the docker backend, a GPU inventory file."""
    from dilu_invoker import doctor
    from dilu_invoker.openwhisk.rest_auth import Authenticator

    Authenticator.from_config(cfg.api)
    if cfg.invoker.backend == "docker":
        docker = doctor.check_docker(cfg)
        if docker.status == doctor.ERROR:
            raise CommandError(f"{docker.detail}; {docker.fix}")
    for flag, path in (("--gpu-inventory", cfg.gpu.inventory),
                       ("--invoker-runtimes-manifest", cfg.invoker.runtimes_manifest)):
        # a manifest may also be given inline as JSON
        if path and not path.lstrip().startswith("{") and not os.path.isfile(os.path.expanduser(path)):
            raise CommandError(f"{flag} {path}: no such file")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _RAW_COMMANDS:
        problem = missing_extra(argv[0])
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
        return int(_resolve(_RAW_COMMANDS[argv[0]][0])(argv[1:]) or 0)
    if len(argv) >= 2 and argv[0] == "standalone" and "--help-all" in argv[1:]:
        build_parser(show_all=True).parse_args([argv[0], "--help"])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    prog = f"dilu-invoker {args.command}"
    try:
        cfg = config.load(args)
        if args.command != "doctor":
            _check_service(cfg)
        if args.command == "standalone":
            _check_standalone(cfg)
        return int(_resolve(_COMMANDS[args.command][0])(cfg, args) or 0)
    except _user_errors() as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
