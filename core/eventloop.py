"""The event loop tidekv's servers run on: uvloop where it is installed, else asyncio's own.

A small request costs the master's event loop more CPU than the master's own work on it, and
uvloop's loop (libuv, in C) far less than asyncio's selector loop: ``tidekv bench master --load N
--groups G`` prints the master's CPU per request on both. ``TIDEKV_EVENT_LOOP`` picks: ``auto``
(default: uvloop if importable), ``uvloop`` (an error if it is not installed) or ``asyncio``. Every tidekv server (the store master, the
proxy, the control channels' ``channel.Server``) makes its loop here. Measurements:
docs/benchmarks/master.md.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from tidekv.errors import ConfigError

VARIABLE = "TIDEKV_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")

T = TypeVar("T")


def kind() -> str:
    """The loop servers run on: "uvloop" or "asyncio" (``TIDEKV_EVENT_LOOP``).

    Raises:
        ConfigError: the variable is none of the choices, or names uvloop where it is not installed.
    """
    wanted = os.environ.get(VARIABLE, "auto") or "auto"
    if wanted not in CHOICES:
        raise ConfigError(f"{VARIABLE}={wanted!r} is invalid; allowed: {', '.join(CHOICES)}")
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if wanted == "uvloop":
            raise ConfigError(f"{VARIABLE}=uvloop but uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop of ``kind()``."""
    if kind() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a loop of ``kind()``."""
    if hasattr(asyncio, "Runner"):  # Python 3.11+
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(main)
    loop = new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
