"""Mooncake's ``mooncake.async_store``: ``MooncakeDistributedStoreAsync``, the drop-in store with
an awaitable ``async_<name>`` beside each method ``<name>``, which runs the method in the event
loop's default executor (a thread), as Mooncake's does.

The wrappers are made on first use and kept on the instance; the sync methods stay as they are.
Neighbours: ``tidekv.compat.mooncake_store`` (the store and its thread-safety: any method from any
thread, so calls awaited together run in parallel threads).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from tidekv.compat.mooncake_store import MooncakeDistributedStore

PREFIX = "async_"


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """``MooncakeDistributedStore`` plus ``await store.async_put(key, value)`` and so on for every
    method; ``setup`` and the rest may still be called as they are."""

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        """``async_<name>``: an awaitable ``<name>``, cached on the instance.

        Raises:
            AttributeError: ``name`` does not start with ``async_``, or ``<name>`` is no method.
        """
        if not name.startswith(PREFIX):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        method = getattr(self, name[len(PREFIX):], None)
        if not callable(method):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' "
                                 f"(nor a method '{name[len(PREFIX):]}' to run asynchronously)")
        wrapper = _in_executor(method)
        setattr(self, name, wrapper)
        return wrapper


def _in_executor(method: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def run(*args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(method, *args, **kwargs))
    return run
