"""structlog set-up: JSON lines when stderr is not a terminal, a readable console otherwise.

Per-activation context (``activation_id``, ``transid``) is bound with structlog's contextvars, so every
line logged while an activation is handled carries it without passing loggers around.

Everything else that writes log lines goes through the same renderer, so a JSON log holds nothing but JSON
lines: the standard ``logging`` module (asyncio's "Unknown child process pid" warnings, aiohttp, aiokafka),
``warnings.warn`` (captured into logging), and an exception that would end the process (``sys.excepthook``).
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType

import structlog

from dilu_invoker.config import LogConfig

#: the handler :func:`configure` installs on the root logger (replaced, not added to, on a second call)
_HANDLER_NAME = "dilu-structlog"


def _shared_processors() -> list[structlog.types.Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def configure(cfg: LogConfig) -> None:
    level = getattr(logging, cfg.level.upper())
    as_json = cfg.json if cfg.json is not None else not sys.stderr.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*_shared_processors(), structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries that use the standard logging module go to stderr at WARNING+, rendered like our own lines
    # (the logger's name in ``logger``).
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *_shared_processors(),
                           structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        # basicConfig's plain-text handler (or ours from an earlier call) would write a second, non-JSON copy.
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(level, logging.WARNING))
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    structlog.get_logger("dilu_invoker").critical("uncaught exception", exc_info=(exc_type, exc, tb))


bind_activation = structlog.contextvars.bind_contextvars
clear_activation = structlog.contextvars.clear_contextvars
#: undo a :data:`bind_activation` with the tokens it returned (restores what was bound before)
reset_activation = structlog.contextvars.reset_contextvars
