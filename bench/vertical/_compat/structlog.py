"""Minimal stand-in for structlog on the GPU machine, which has torch but none of the service's packages.

bench/vertical/h200.py puts this directory on sys.path only when ``import structlog`` fails, so the
GPU manager and node run unchanged; their events go to the standard logging module as ``event k=v ...``.
"""

from __future__ import annotations

import logging
from typing import Any


class _Logger:
    def __init__(self, name: str, context: dict[str, Any]) -> None:
        self._log = logging.getLogger(name)
        self._context = context

    def bind(self, **kw: Any) -> _Logger:
        return _Logger(self._log.name, {**self._context, **kw})

    def _emit(self, level: int, event: str, kw: dict[str, Any], exc_info: bool = False) -> None:
        if self._log.isEnabledFor(level):
            fields = " ".join(f"{k}={v!r}" for k, v in {**self._context, **kw}.items())
            self._log.log(level, f"{event} {fields}".rstrip(), exc_info=exc_info)

    def debug(self, event: str, **kw: Any) -> None:
        self._emit(logging.DEBUG, event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit(logging.INFO, event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit(logging.WARNING, event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit(logging.ERROR, event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        self._emit(logging.ERROR, event, kw, exc_info=True)


def get_logger(name: str = "dilu", **context: Any) -> _Logger:
    return _Logger(name, context)
