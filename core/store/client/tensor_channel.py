"""TensorChannel: a named stream of tensors between producers and consumers that are not in
lock-step (hidden states from an inference engine to a draft-model trainer, rollout batches to a
trainer), on the store: each tensor an object, the queue an index on the master
(``tidekv.store.master.channels``).

A producer puts its tensors (hard-pinned: eviction leaves them) and pushes their keys; a push
that would pass the channel's bound (``max_items`` items, ``max_bytes`` bytes) is refused, and
the producer then waits for room (``when_full="block"``, up to ``timeout_s``) or raises
``ChannelFullError`` at once (``"refuse"``), removing what it had put either way. A consumer
takes the oldest ready items with their locations under a read lease (they are hidden from other
consumers for ``visibility_s``, and until that lease ends), reads their tensors in one batch and
acks them when done; an ack removes item and object, and frees the bytes at once. Delivery is
**at least once**: an item not acked within ``visibility_s`` (a consumer that died, or was slow)
is handed out again, to any consumer. Seqs grow and are never reused, also across master
restarts and failovers, so a consumer that must act once per item drops seqs it has seen.

A channel lives on the master group its name hashes to, and its producers name their objects so
they hash to the same group. Neighbours: ``tensors`` (the tensor objects), ``store``.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidekv.errors import ChannelFullError, ConfigError, LeaseExpiredError, StoreError, TidekvError
from tidekv.store.client.tensors import read_object, tensor_spans, torch_module
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Pin, Status

if TYPE_CHECKING:
    import torch
    from tidekv.store.client.master_client import MasterClient
    from tidekv.store.client.store import Store

logger = logging.getLogger(__name__)

_AHEAD = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tidekv-channel-ahead")
"""Where read-ahead takes run (each thread with its own connection to the master)."""

KEY_PREFIX = "tidekv-channel/"
"""Items' objects are named ``tidekv-channel/<channel>/<producer's random prefix>-<counter>``."""
WHEN_FULL = ("block", "refuse")
WAIT_S = 1.0
"""The longest one request of a waiting take or producer waits on the master (it answers as soon
as the channel changes); a longer wait is several of them, each well within the RPC timeout."""


@dataclass(frozen=True)
class Delivery:
    """One item a consumer took: its sequence number (ack it with ``TensorChannel.ack``) and tensor."""

    seq: int
    tensor: torch.Tensor


class TensorChannel:
    """Producer and consumer ends of channel ``name`` (one object can be both).

    Args:
        store: the Store whose pool holds the items.
        name: the channel; every producer and consumer of it names it alike.
        max_items: the most items the channel may hold when this producer appends.
        max_bytes: the most bytes the channel may hold when this producer appends.
        when_full: "block" (wait up to ``timeout_s`` for room) or "refuse" (raise at once).
        timeout_s: how long a blocked put waits before ``ChannelFullError``.
        visibility_s: how long an item this consumer takes is hidden from others before it is
            handed out again unless acked.
        consumer: this consumer's name in the master's bookkeeping (default: host and pid).
        read_ahead: a take that gets items also takes the next batch (as many, in the background,
            while it reads these), so the next take reads at once: the master's round trip of a
            consume loop overlaps its reads. The batch taken ahead is this consumer's, hidden
            from others, until it is taken, acked or ``visibility_s`` runs out (a consumer that
            stops leaves it to come back then). One thread takes from a channel object at a time.
    """

    def __init__(self, store: Store, name: str, *, max_items: int = 1024, max_bytes: int = 1 << 30,
                 when_full: str = "block", timeout_s: float = 60.0, visibility_s: float = 60.0,
                 consumer: str | None = None, read_ahead: bool = False) -> None:
        if not name or "/" in name:
            raise ConfigError(f"channel name {name!r}: expected a non-empty name without '/'")
        if when_full not in WHEN_FULL:
            raise ConfigError(f"when_full={when_full!r}: expected one of {WHEN_FULL}")
        if max_items < 1 or max_bytes < 1 or timeout_s < 0 or visibility_s <= 0:
            raise ConfigError(f"max_items={max_items}, max_bytes={max_bytes}, timeout_s={timeout_s} and "
                              f"visibility_s={visibility_s}: expected positive values")
        self.store, self.name = store, name
        self.max_items, self.max_bytes = max_items, max_bytes
        self.when_full, self.timeout_s, self.visibility_s = when_full, timeout_s, visibility_s
        self.consumer = consumer or f"{os.uname().nodename}:{os.getpid()}"
        self._group = store._pool.map.group_of(name.encode())
        self._rpc = store._groups[self._group].rpc
        self.read_ahead = read_ahead
        # Items' keys: a random prefix of this object's own, then a counter (unique without a uuid each)
        self._key_prefix = f"{KEY_PREFIX}{name}/{uuid.uuid4().hex}-"
        self._key_counter = itertools.count()
        self._one_group = len(store._groups) == 1
        self._ahead: Future[tuple[float, list[p.ChannelItem]]] | None = None  # the take sent ahead

    # ---- producing ----------------------------------------------------------------------

    def put(self, tensor: Any) -> int:
        """Appends one tensor; returns its seq."""
        return self.put_many([tensor])[0]

    def put_many(self, tensors: Sequence[Any]) -> list[int]:
        """Appends tensors in order (one put batch whose end appends them: three round trips to
        the master become two); returns their seqs. A tensor put again after its holder failed
        mid-put is appended after the others.

        Raises:
            ChannelFullError: no room within ``timeout_s`` ("block") or now ("refuse"); the
                tensors not appended were removed from the pool (``err.appended`` counts the
                ones before them that were).
            StoreError, TransferError: the put failed for some tensors (``err.failed_keys``);
                those and any not appended were removed, ``err.appended`` counts the ones that were.
        """
        keys = [self._item_key() for _ in tensors]
        pushed: dict[bytes, tuple[int, int]] = {}  # key -> (Status, seq) of its append at put_end

        def publish(ended: list[bytes], tokens: list[int]) -> list[int]:
            statuses, appended, seqs = self._rpc.call(p.ChannelPublish(self.store.client_id, ended, tokens, self.name,
                                                                       self.max_items, self.max_bytes))
            pushed.update(zip(ended, zip(appended, seqs)))
            return statuses

        try:
            with tensor_spans(self.store, tensors) as spans:
                self.store._groups[self._group].io.put(keys, spans, Pin.HARD, None, False,
                                                       self.store._placement(None), publish=publish)
        except TidekvError as exc:
            self.store.remove_many([k for k in keys if pushed.get(k, (Status.FULL,))[0] != Status.OK], force=True)
            exc.appended = sum(1 for status, _ in pushed.values() if status == Status.OK)
            raise
        seqs = [pushed[key][1] if pushed[key][0] == Status.OK else -1 for key in keys]
        todo = [i for i, key in enumerate(keys) if pushed[key][0] != Status.OK]
        deadline = time.monotonic() + self.timeout_s
        while todo:
            i = next((i for i in todo if pushed[keys[i]][0] != Status.FULL), None)
            if i is not None:
                self.store.remove_many([keys[j] for j in todo], force=True)
                raise StoreError(f"channel {self.name!r}: item {keys[i]!r} vanished before it was appended "
                                 f"({Status(pushed[keys[i]][0]).name})")
            if self.when_full == "refuse" or time.monotonic() >= deadline:
                self.store.remove_many([keys[i] for i in todo], force=True)
                err = ChannelFullError(
                    f"channel {self.name!r} is full (at most {self.max_items} items and {self.max_bytes} bytes): "
                    f"{len(todo)} of {len(keys)} tensors not appended"
                    + ("" if self.when_full == "refuse" else f" after waiting {self.timeout_s:g} s"))
                err.appended = len(keys) - len(todo)
                raise err
            # Answered at once if there is room for some, else when an ack makes room, or empty-handed.
            statuses, got = self._waiting().call(p.ChannelPush(self.name, [keys[i] for i in todo], self.max_items,
                                                               self.max_bytes, self._wait_s(deadline)))
            pushed.update((keys[i], (status, seq)) for i, status, seq in zip(todo, statuses, got))
            for i, status, seq in zip(todo, statuses, got):
                if status == Status.OK:
                    seqs[i] = seq
            todo = [i for i in todo if seqs[i] < 0]  # in order: only what was refused is retried
        return seqs

    # ---- consuming ----------------------------------------------------------------------

    def take(self, max_items: int = 1, timeout_s: float | None = None, *,
             ack: Sequence[Delivery | int] = ()) -> list[Delivery]:
        """Up to ``max_items`` items, oldest first, waiting up to ``timeout_s`` (None: forever,
        0: not at all) for the first; [] when none came. Ack each when done with it: by ``ack()``,
        or by passing the items done with as ``ack`` to the next take, which acks them in the same
        round trip to the master (a consume loop: ``items = ch.take(n, ack=items)``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        acks = [it.seq if isinstance(it, Delivery) else int(it) for it in ack]
        while True:
            ahead, self._ahead = self._ahead, None
            lease_until, items = ahead.result() if ahead is not None else (0.0, [])
            if not items:
                # The master answers when items are ready (at once if some are), or empty-handed.
                lease_until, items = self._take_now(max_items, acks, self._wait_s(deadline))
                acks = []  # acked with this call
            if items and self.read_ahead:  # the next batch is taken while these are read
                self._ahead = _AHEAD.submit(self._take_now, max_items, acks)
                acks = []
            if items:
                out = self._read(items, lease_until)
                if out:
                    return out
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def ack(self, items: Sequence[Delivery | int]) -> int:
        """Marks items done (they and their tensors leave the pool); returns how many were still
        there (the others were acked already, e.g. by a consumer they were handed to again)."""
        seqs = [it.seq if isinstance(it, Delivery) else int(it) for it in items]
        if not seqs:
            return 0
        return sum(1 for s in self._rpc.call(p.ChannelAck(self.name, seqs, self.consumer)) if s == Status.OK)

    def info(self) -> dict[str, Any]:
        """The channel on its master: items (ready + taken), bytes, the next seq, items lost."""
        return dict(self._rpc.call(p.ChannelInfo(self.name)))

    def _read(self, items: list[p.ChannelItem], lease_deadline: float) -> list[Delivery]:
        """The items' tensors, read where the take said under its lease, into one registered buffer
        (``Store.read_buffers``: reused once the tensors of an earlier take are gone). An item whose
        replicas could not be read is left out (it is handed out again after ``visibility_s``), and
        logged; so is one removed meanwhile."""
        torch = torch_module()
        keys = [it.key for it in items]
        buffers = self.store.read_buffers
        view, address = buffers.take(sum(it.size for it in items))
        whole = torch.frombuffer(view, dtype=torch.uint8)
        bufs, pieces, offsets, offset = [], [], [], 0
        for it in items:
            bufs.append(whole[offset:offset + it.size])
            pieces.append([(address + offset, it.size, 0)])
            offsets.append(offset)
            offset += it.size
        failed: set[bytes] = set()
        results = [p.GetResult(Status.OK, it.size, it.locations) for it in items]
        try:
            self.store._groups[self._group].io.read(keys, results, pieces, lease_deadline)
        except LeaseExpiredError:
            buffers.spoil(address)  # (below: a read that did not end clean)
            # The bytes of a channel's item are freed only when its object is removed (it is
            # hard-pinned): one that still exists after the read was read whole.
            failed = {k for k, ok in zip(keys, self.store.exists_many(keys)) if not ok}
            logger.info("channel %r: a read outlived its lease; %d of %d item(s) were removed meanwhile "
                        "(acked elsewhere) and are left out", self.name, len(failed), len(keys))
        except TidekvError as exc:
            buffers.spoil(address)
            if not exc.failures:
                raise
            failed = {k for k, _ in exc.failures}
            logger.warning("channel %r: %d item(s) could not be read (%s); they come back after visibility_s",
                           self.name, len(failed), exc)
        except BaseException:
            buffers.spoil(address)
            raise
        return [Delivery(it.seq, read_object(buf, it.key, view[at:at + it.size])[1])
                for it, buf, at in zip(items, bufs, offsets) if it.key not in failed]

    def _take_now(self, max_items: int, acks: list[int], wait_s: float = 0.0) -> tuple[float, list[p.ChannelItem]]:
        """One take request (read-ahead's, on its own thread, does not wait): when its items'
        read lease ends (monotonic), and the items."""
        started = time.monotonic()
        lease_s, items = self._waiting().call(p.ChannelTake(self.name, self.consumer, max_items, self.visibility_s,
                                                            acks, wait_s))
        return (started + lease_s if lease_s > 0 else float("inf")), items

    def _waiting(self) -> MasterClient:
        """The connection this thread's waits on the channel's master go over."""
        return self.store._pool.waiting(self._group)

    def _wait_s(self, deadline: float | None) -> float:
        """How long the next request may wait on the master, up to ``deadline`` (None: no end)."""
        cap = min(WAIT_S, self._rpc.timeout_s / 2)  # (the waits' connections have the same timeout)
        return cap if deadline is None else max(0.0, min(cap, deadline - time.monotonic()))

    def _item_key(self) -> bytes:
        """A fresh key that hashes to this channel's master group."""
        while True:
            key = f"{self._key_prefix}{next(self._key_counter)}".encode()
            if self._one_group or self.store._pool.map.group_of(key) == self._group:
                return key
