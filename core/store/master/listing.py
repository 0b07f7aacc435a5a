"""Key listings (``ListKeys``): a connection pages through the keys of complete objects as they
were when its listing began.

A listing is a copy of the key set taken when it starts, held by the connection's session
(``listing``, ``listed``), so no page costs more than a bounded number of lookups; keys removed
since the start are skipped, keys put since are not listed. At most ``MAX_LISTINGS`` connections
hold one at a time. Neighbours: ``master`` (the sessions, and the ``ListKeys`` request's checks),
``objects`` (the key set).
Design notes: docs/store-design.md#tidekvstoremasterlisting
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tidekv.errors import ConfigError

MAX_LISTINGS = 64
"""Connections that may hold a key listing at once: each holds a copy of the key set."""


class Tiers(Mapping[bytes, Any]):
    """The objects in memory and the disk-only ones (``disks``), as one key set to list."""

    def __init__(self, memory: Mapping[bytes, Any], disk: Mapping[bytes, Any]) -> None:
        self._memory, self._disk = memory, disk

    def __getitem__(self, key: bytes) -> Any:
        meta = self._memory.get(key)
        return meta if meta is not None else self._disk[key]

    def __iter__(self) -> Iterator[bytes]:
        yield from self._memory
        yield from (k for k in self._disk if k not in self._memory)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class KeyListings:
    """The listings open on one master; a session holds at most one."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()  # sessions holding a listing

    def page(self, session: Any, start: bool, limit: int, objects: Mapping[bytes, Any],
             owns: Callable[[bytes], bool] | None) -> tuple[list[bytes], bool]:
        """Up to ``limit`` keys of ``session``'s listing (a new one with ``start``; ``owns``:
        which keys it may see, None for all), and whether it is the last page."""
        if start:
            session.listing = None
            self._open.discard(session)
            if len(self._open) >= MAX_LISTINGS:
                raise ConfigError(f"{len(self._open)} connections are listing keys already (at most "
                                  f"{MAX_LISTINGS}); retry once one has finished")
            session.listing = list(objects) if owns is None else [k for k in objects if owns(k)]
            session.listed = 0
            self._open.add(session)
        elif session.listing is None:
            raise ConfigError("ListKeys(start=False) without a listing on this connection; start one (start=True)")
        listing = session.listing
        page: list[bytes] = []
        i = session.listed
        end = min(len(listing), i + 8 * limit)  # keys removed since the start are skipped, within bounds
        while i < end and len(page) < limit:
            meta = objects.get(listing[i])
            if meta is not None and meta.put is None:  # complete (pending upserts keep the old version listed)
                page.append(listing[i])
            i += 1
        session.listed = i
        is_last = i >= len(listing)
        if is_last:
            session.listing = None
            self._open.discard(session)
        return page, is_last
