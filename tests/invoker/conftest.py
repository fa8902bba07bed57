"""The invoker every test here shares unless it builds its own: the process backend, 1 GiB of user memory."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from tests.ow_support.invoker import config_with


@pytest.fixture
async def invoker() -> AsyncIterator[Invoker]:
    async with open_invoker(config_with(user_memory_mb=1024, idle_timeout_s=60)) as inv:
        yield inv
