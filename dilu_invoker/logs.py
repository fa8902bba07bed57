"""structlog set-up: JSON lines when stderr is not a terminal, a readable console otherwise.

Per-activation context (``activation_id``, ``transid``) is bound with structlog's contextvars, so every
line logged while an activation is handled carries it without passing loggers around.
"""

from __future__ import annotations

import logging
import sys

import structlog

from dilu_invoker.config import LogConfig


def configure(cfg: LogConfig) -> None:
    level = getattr(logging, cfg.level.upper())
    as_json = cfg.json if cfg.json is not None else not sys.stderr.isatty()
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries that use the standard logging module (aiohttp, aiokafka) go to stderr at WARNING+.
    logging.basicConfig(level=max(level, logging.WARNING), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


bind_activation = structlog.contextvars.bind_contextvars
clear_activation = structlog.contextvars.clear_contextvars
