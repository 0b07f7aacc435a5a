"""A pool's master groups as one: a MasterClient per group, which group owns each key
(``wire.pool_map``), and a batch call fanned out to the groups in parallel and merged back into
the caller's key order.

With one group (a lone master or one HA cluster: every pool before sharding) a batch goes
straight to its client, in the calling thread, with its errors unchanged. With several, each
group's share runs on its own thread (the first in the caller's), and a group that fails fails
only its keys: the batch raises one error whose ``failures`` name every failed key (the
``errors`` batch convention) after the other groups have answered. Thread-safe.
Neighbours: ``master_client`` (one group), ``client`` (the Store's data calls go through
``fan_out``). Design notes: docs/design-sharding.md
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tidekv.config import PoolAddress
from tidekv.errors import TidekvError
from tidekv.store.client.master_client import MasterClient
from tidekv.store.client.object_io import batch_error
from tidekv.store.wire.keys import Key, key_bytes
from tidekv.store.wire.pool_map import PoolMap

T = TypeVar("T")

GroupCall = Callable[[int, list[int]], Sequence[T]]
"""One group's share of a batch: (group index, positions of its keys) -> a result per position."""


def pick(items: Sequence[Any], positions: list[int]) -> list[Any]:
    """``items`` at ``positions`` (ascending, distinct): ``items`` itself when they are all of a list."""
    if isinstance(items, list) and len(positions) == len(items):
        return items
    return [items[i] for i in positions]


class Pool:
    """The master groups of ``address``, one ``MasterClient`` each (made with ``client_args``).

    The lookups an engine's scheduler and the proxy make (``exists_many``, ``exists_leased``,
    ``locate_many``) have MasterClient's signatures, so either serves them.
    """

    def __init__(self, address: str | Sequence[str] | PoolAddress, client_id: str, **client_args: Any) -> None:
        self.pool = PoolAddress.parse(address)
        self.map = PoolMap([name for name, _ in self.pool.groups])
        self._client_id, self._client_args = client_id, client_args
        self._waits: dict[tuple[int, int], MasterClient] = {}  # (group, thread) -> its client for waits
        self._waits_lock = threading.Lock()
        self.clients: list[MasterClient] = []
        try:
            for _, group in self.pool.groups:
                self.clients.append(MasterClient(group, client_id, **client_args))
        except BaseException:
            self.close()
            raise
        n = len(self.clients)
        self._executor = ThreadPoolExecutor(n - 1, thread_name_prefix="tidekv-pool") if n > 1 else None

    @property
    def names(self) -> tuple[str, ...]:
        return self.map.names

    def __len__(self) -> int:
        return len(self.clients)

    def fan_out(self, keys: Sequence[bytes], call: GroupCall[T], op: str) -> list[T]:
        """Runs ``call`` for each group's share of ``keys`` and returns its results in key order.

        Raises:
            TidekvError: with one group, whatever ``call`` raised; with several, after every group
                answered, one error for all the failed keys (``failures``: key -> error; a group
                whose call raised without naming keys fails all of its keys with that error).
        """
        shares = self.map.split(keys)
        if self._executor is None:
            return list(call(0, shares[0][1])) if shares else []
        out: list[Any] = [None] * len(keys)
        failures: dict[bytes, Any] = {}
        pending: list[tuple[list[int], Future[Sequence[T]]]] = [
            (positions, self._executor.submit(call, group, positions)) for group, positions in shares[1:]]
        first = shares[0] if shares else None
        if first is not None:
            self._gather(keys, first[1], lambda: call(first[0], first[1]), out, failures)
        for positions, future in pending:
            self._gather(keys, positions, future.result, out, failures)
        if failures:
            raise batch_error(op, failures)
        return out

    @staticmethod
    def _gather(keys: Sequence[bytes], positions: list[int], result: Callable[[], Sequence[Any]], out: list[Any],
                failures: dict[bytes, Any]) -> None:
        try:
            for i, value in zip(positions, result()):
                out[i] = value
        except TidekvError as exc:
            if exc.failures:
                failures.update(exc.failures)
            else:
                failures.update((keys[i], exc) for i in positions)

    def each(self, call: Callable[[MasterClient], T]) -> list[T]:
        """``call`` on every group's client, in parallel; its results in group order. Raises the
        first group's error (in group order) after all have answered."""
        if self._executor is None:
            return [call(self.clients[0])]
        futures = [self._executor.submit(call, c) for c in self.clients[1:]]
        results: list[Any] = []
        error: BaseException | None = None
        for get in [lambda: call(self.clients[0])] + [f.result for f in futures]:
            try:
                results.append(get())
            except TidekvError as exc:
                error = error or exc
        if error is not None:
            raise error
        return results

    # ---- lookups (MasterClient's signatures) --------------------------------------------

    def connect(self) -> None:
        """Connects to every group (``MasterClient.connect``); raises the first group's error."""
        self.each(lambda c: c.connect())

    def waiting(self, group: int) -> MasterClient:
        """This thread's own client of group ``group``'s master, for requests that wait there (a
        channel's take, a producer waiting for room): on a connection of its own that says no
        hello, so one that waits holds up no other call of the pool, nor another thread's wait.
        Those of threads that ended are closed here; the rest with the pool."""
        me = (group, threading.get_ident())
        with self._waits_lock:
            client = self._waits.get(me)
            if client is None:
                alive = {t.ident for t in threading.enumerate()}
                for gone in [k for k in self._waits if k[1] not in alive]:
                    self._waits.pop(gone).close()
                client = self._waits[me] = MasterClient(self.pool.groups[group][1], self._client_id,
                                                        **{**self._client_args, "register": False})
            return client

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        bkeys = [key_bytes(k) for k in keys]
        return self.fan_out(bkeys, lambda g, pos: self.clients[g].exists_many(pick(bkeys, pos)), "exists")

    def exists_leased(self, keys: Sequence[Key]) -> list[bool]:
        bkeys = [key_bytes(k) for k in keys]
        return self.fan_out(bkeys, lambda g, pos: self.clients[g].exists_leased(pick(bkeys, pos)), "exists")

    def locate_many(self, keys: Sequence[Key]) -> list[list[str]]:
        bkeys = [key_bytes(k) for k in keys]
        return self.fan_out(bkeys, lambda g, pos: self.clients[g].locate_many(pick(bkeys, pos)), "locate")

    def call_each(self, body: Any, **kwargs: Any) -> list[Any]:
        """One request to every group (``MasterClient.call``); the answers in group order."""
        return self.each(lambda c: c.call(body, **kwargs))

    @property
    def address(self) -> str:
        """What the clients talk to now, for messages: each group's ``MasterClient.address``."""
        return "; ".join(c.address for c in self.clients)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        with self._waits_lock:
            for client in self._waits.values():
                client.close()
            self._waits.clear()
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)

