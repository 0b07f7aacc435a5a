"""Channels: bounded queues of objects on the master, the index behind ``tidekv.TensorChannel``.

A channel is a name, a sequence counter and the items not yet acknowledged: (seq, key, size) of
complete objects its producers put (hard-pinned, so eviction leaves them) and then pushed. A
push is refused (``Status.FULL``) when the queue would pass the producer's ``max_items`` or
``max_bytes``. A take hands a consumer the oldest ready items and hides them for
``visibility_s`` (and its read lease); an ack removes an item and its object. An item not acked in time is ready
again, so delivery is at least once and in sequence order among ready items; a consumer that
dies loses nothing it had not acknowledged. Seqs are never reused (the counter is journaled with
every push), so consumers can drop repeats by seq.

A take or a push may wait on the master (``wait_s``): the service answers it with a
``PendingWait``, the connection holds it, and the server handles it again when its channel is in
``changed`` (items pushed or ready again, room freed) or its time is up.

Pushes and acks are journaled (``journal.ChannelOp``, ``ChannelAckOp``); who holds a taken item
is not: after a restart or a failover every unacknowledged item is ready again. An item whose
object is gone (removed by force, its holder lost) is dropped at take and counted.
Neighbours: ``objects`` (the items' objects), ``service`` (the requests), ``journal``.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidekv.store.master import journal as j
from tidekv.store.master.index import lease_ticks
from tidekv.store.master.objects import ObjectTable
from tidekv.store.wire.protocol import ChannelItem, Status

if TYPE_CHECKING:
    from tidekv.store.master.session import Session

logger = logging.getLogger(__name__)


MAX_WAIT_S = 30.0
"""The longest a channel's take or push waits on the master (a longer ``wait_s`` is cut to it)."""


class PendingWait:
    """A channel request that found nothing to do yet (a take no item was ready for, a push the
    bounds refused whole) and asked to wait: its connection holds it and hands ``data`` to
    ``MasterService.handle`` again when ``channel`` changes (``ChannelTable.changed``), and a
    last time, with ``final``, once ``wait_s`` has passed."""

    __slots__ = ("data", "session", "channel", "wait_s", "since")

    def __init__(self, data: bytes, session: Session | None, channel: str, wait_s: float, since: float) -> None:
        self.data, self.session, self.channel, self.wait_s = data, session, channel, wait_s
        self.since = since  # the service's clock when it was first handled


class Wait(Exception):
    """Raised by a channel handler that found nothing to do and may wait: ``handle`` answers
    with a ``PendingWait``."""

    def __init__(self, channel: str, wait_s: float) -> None:
        super().__init__(f"waits up to {wait_s} s on channel {channel!r}")
        self.channel, self.wait_s = channel, min(wait_s, MAX_WAIT_S)


@dataclass
class _Channel:
    next_seq: int = 0
    items: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # seq -> (key, size), not acked
    seq_of: dict[bytes, int] = field(default_factory=dict)  # key -> seq of each item (a push sent again finds it)
    ready: list[int] = field(default_factory=list)  # a heap of seqs that may be taken (acked ones are skipped)
    taken: dict[int, tuple[str, float, float]] = field(default_factory=dict)  # seq -> (consumer, ready again at,
    #                                                                             its read lease's end)
    hidden: list[tuple[float, int]] = field(default_factory=list)  # a heap of (ready again at, seq) of taken ones
    bytes: int = 0
    lost: int = 0  # items dropped because their object was gone


class ChannelTable:
    """Every channel of one master (see the module docstring)."""

    def __init__(self, objects: ObjectTable) -> None:
        self.objects = objects
        self.channels: dict[str, _Channel] = {}
        self.changed: set[str] = set()  # channels that gained ready items or room since the server last looked

    def push(self, name: str, keys: list[bytes], max_items: int, max_bytes: int) -> tuple[list[int], list[int]]:
        """Appends complete objects; per key (Status, seq): OK, NOT_FOUND (no complete object),
        FULL (the queue would pass a bound; nothing of that key was appended). A key already in
        the channel is answered OK with its seq, so a push sent again (its reply lost with the
        connection) appends nothing twice."""
        ch = self.channels.setdefault(name, _Channel())
        statuses, seqs, pushed = [], [], []
        for key in keys:
            seq = ch.seq_of.get(key)
            if seq is not None:
                statuses.append(int(Status.OK))
                seqs.append(seq)
                continue
            meta = self.objects.objects.get(key)
            if meta is None or meta.put is not None:
                statuses.append(int(Status.NOT_FOUND))
                seqs.append(-1)
                continue
            if len(ch.items) + 1 > max_items or ch.bytes + meta.size > max_bytes:
                statuses.append(int(Status.FULL))
                seqs.append(-1)
                continue
            seq = ch.next_seq
            ch.next_seq += 1
            ch.items[seq] = (key, meta.size)
            ch.seq_of[key] = seq
            ch.bytes += meta.size
            heapq.heappush(ch.ready, seq)
            statuses.append(int(Status.OK))
            seqs.append(seq)
            pushed.append(key)
        if pushed:
            self.changed.add(name)
        if pushed and self.objects.journal is not None:
            done = [s for s in seqs if s >= 0]
            self.objects.journal.add(j.ChannelOp(name, done, pushed, ch.next_seq), *pushed)
        return statuses, seqs

    def take(self, name: str, consumer: str, max_items: int, visibility_s: float, lease_s: float,
             now: float) -> list[ChannelItem]:
        """Up to ``max_items`` ready items, oldest first, with their locations under a read lease
        of ``lease_s``; hidden from others for ``visibility_s`` and, whatever that is, until the
        lease ends (so a consumer reading one is the only one holding a lease from a take)."""
        ch = self.channels.get(name)
        if ch is None:
            return []
        self._requeue(ch, now)
        out: list[ChannelItem] = []
        gone: list[int] = []
        while ch.ready and len(out) < max_items:
            seq = heapq.heappop(ch.ready)
            if seq not in ch.items:
                continue  # acked while ready
            key, _ = ch.items[seq]
            found = self.objects.get(key, lease_s, now)
            if found.status != Status.OK:
                gone.append(seq)
                continue
            until = now + max(visibility_s, lease_s)
            ch.taken[seq] = (consumer, until, now + lease_s)
            heapq.heappush(ch.hidden, (until, seq))
            out.append(ChannelItem(seq, key, found.size, found.locations))
        if gone:
            ch.lost += len(gone)
            logger.warning("channel %r: %d item(s) dropped, their objects are gone (removed by force or their holder "
                           "lost): seqs %s", name, len(gone), gone[:10])
            self._forget(name, ch, gone)
        return out

    def ack(self, name: str, seqs: list[int], consumer: str, now: float) -> list[int]:
        """Removes acknowledged items and their objects; per seq OK or NOT_FOUND (acked before).
        The consumer holding an item is done reading it: when no lease but its take's is on the
        object, the bytes are freed at once rather than when that lease would have ended."""
        ch = self.channels.get(name)
        if ch is None:
            return [int(Status.NOT_FOUND)] * len(seqs)
        found = [s for s in dict.fromkeys(seqs) if s in ch.items]
        keys = []
        for seq in found:
            key = ch.items[seq][0]
            holder = ch.taken.get(seq)
            meta = self.objects.objects.get(key)
            # (compared as the index keeps leases: to 2^-20 s, rounded up)
            if holder is not None and holder[0] == consumer and meta is not None \
                    and lease_ticks(meta.lease_until) <= lease_ticks(holder[2]):
                meta.lease_until = min(meta.lease_until, now)
            keys.append(key)
        self._forget(name, ch, found)
        for key in keys:
            self.objects.remove(key, True, now)
        done = set(found)
        return [int(Status.OK) if s in done else int(Status.NOT_FOUND) for s in seqs]

    def tick(self, now: float) -> None:
        """Makes items whose visibility ran out ready again."""
        for name, ch in self.channels.items():
            if self._requeue(ch, now):
                self.changed.add(name)

    def info(self, name: str, now: float) -> dict[str, Any]:
        ch = self.channels.get(name)
        if ch is None:
            return {"items": 0, "ready": 0, "taken": 0, "bytes": 0, "next_seq": 0, "lost": 0}
        self._requeue(ch, now)
        return {"items": len(ch.items), "ready": len(ch.items) - len(ch.taken), "taken": len(ch.taken),
                "bytes": ch.bytes, "next_seq": ch.next_seq, "lost": ch.lost}

    def snapshot(self) -> list[j.Op]:
        """Ops that rebuild every channel: its items (all ready again) and its counter."""
        return [j.ChannelOp(name, list(ch.items), [k for k, _ in ch.items.values()], ch.next_seq)
                for name, ch in self.channels.items()]

    def restore(self, mirror: j.Mirror) -> None:
        """Channels from a mirror: every unacknowledged item ready, sizes from the objects."""
        for name, (next_seq, items) in mirror.channels.items():
            ch = _Channel(next_seq)
            for seq, key in sorted(items.items()):
                meta = self.objects.objects.get(key)
                ch.items[seq] = (key, meta.size if meta is not None else 0)
                ch.seq_of[key] = seq
                ch.bytes += ch.items[seq][1]
                ch.ready.append(seq)
            self.channels[name] = ch

    def _requeue(self, ch: _Channel, now: float) -> bool:
        """Makes ``ch``'s items whose visibility ran out ready again; whether there were any."""
        hidden = ch.hidden
        again = False
        while hidden and hidden[0][0] <= now:
            until, seq = heapq.heappop(hidden)
            held = ch.taken.get(seq)
            if held is not None and held[1] == until:  # else acked, or taken again since
                del ch.taken[seq]
                heapq.heappush(ch.ready, seq)
                again = True
        return again

    def _forget(self, name: str, ch: _Channel, seqs: list[int]) -> None:
        """Items gone (acked, or their objects lost): their heap entries are skipped when reached."""
        if not seqs:
            return
        self.changed.add(name)  # room for blocked producers
        for seq in seqs:
            key, size = ch.items.pop(seq)
            ch.seq_of.pop(key, None)
            ch.bytes -= size
            ch.taken.pop(seq, None)
        if self.objects.journal is not None:  # no key changes with it: the objects' removals name theirs
            self.objects.journal.add(j.ChannelAckOp(name, seqs))
