"""leanhttp.loop.run: the coroutine's result, on uvloop when it is installed, asyncio's loop
when it is not."""

from __future__ import annotations

import asyncio
import sys

import pytest

from leanhttp.loop import run


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_runs_on_uvloop_when_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert run(_loop_module()).startswith("uvloop")


def test_runs_on_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert run(_loop_module()).startswith("asyncio")


def test_an_exception_of_the_coroutine_reaches_the_caller() -> None:
    async def fails() -> None:
        raise LookupError("from the coroutine")

    with pytest.raises(LookupError, match="from the coroutine"):
        run(fails())
