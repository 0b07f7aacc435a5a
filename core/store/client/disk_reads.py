"""Reads of disk-only objects: the holder reads and verifies the record, the bytes land in the
reader's registered memory with no copy on the reader's side.

A reader on the holder itself reads its own disk straight into the destination (``DiskTier``:
direct I/O where the memory allows). A reader elsewhere asks the holder's disk server (this
module's channel, ``SPEC``): the holder reads the records into its staging memory, verifies
them, and writes them one-sided into the reader's memory through its transfer engine, then
answers per record. A record that fails its checksum or names another object is a miss
(``DiskCorruptError``), never returned as data. Neighbours: ``disk`` (the files),
``object_io`` (reads disk-only objects through ``DiskReader``), ``master.disks`` (the index).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import threading
from collections.abc import Iterator
from typing import Any, Union

import msgspec
from tidekv import channel
from tidekv.errors import DiskCorruptError, ObjectNotFoundError, StoreError, TidekvError
from tidekv.store.allocator import align as _staged  # each record 64-byte aligned in a round
from tidekv.store.client.disk import DiskRecord, DiskTier
from tidekv.store.client.staging import StagingArea
from tidekv.store.wire import protocol as p
from tidekv.transfer import TransferEngine, TransferOp, TransferRequest, TransferState

logger = logging.getLogger(__name__)

MAGIC = b"tkd\x01"
VERSION = 1
MAX_BATCH_BYTES = 32 << 20
"""Bytes a disk server stages at once for one request (more are read and sent in rounds)."""

Pieces = list[tuple[int, int, int]]
"""Where an object's bytes go: (address, length, offset in the object) each."""


class Outcome(enum.IntEnum):
    OK = 0
    MISSING = 1  # no such disk here, or the record is gone
    CORRUPT = 2  # failed its checksum, or names another object
    UNSENT = 3  # read, but the write into the reader's memory failed


class DiskReadItem(msgspec.Struct, array_like=True):
    disk: str
    offset: int
    key: bytes
    token: int
    size: int
    crc: int
    pieces: list[tuple[int, int, int]]  # in the reader's memory


class DiskRead(msgspec.Struct, tag="disk_read", array_like=True):
    """Read these records into the memory of the reader whose engine is ``reader``."""

    reader: str
    items: list[DiskReadItem]


Body = Union[DiskRead]

SPEC = channel.Spec(
    label="disk", magic=MAGIC, version=VERSION, body=Body, server_name="disk server",
    unavailable=lambda message, sent: StoreError(message), failed=StoreError, results={DiskRead: list[int]},
    hint="is the holder that spilled the object still running?")
"""The disk tier's read channel: a reader asks a holder's disk server."""


def record_of(tier: DiskTier, disk: str, offset: int, key: bytes, token: int, size: int, crc: int) -> DiskRecord | None:
    """The record ``tier`` would hold for a copy, or None when ``disk`` is not one of its disks."""
    try:
        index = tier.ids.index(disk)
    except ValueError:
        return None
    return DiskRecord(key, token, size, crc, index, offset)


def read_local(tier: DiskTier, staging: StagingArea, items: list[tuple[DiskRecord, Pieces]]) -> list[Exception | None]:
    """Reads records of this holder's ``tier`` into local memory: one piece covering the whole
    object straight from the disk, others through staging memory."""
    out: list[Exception | None] = [None] * len(items)
    whole = [(i, rec, pieces[0][0]) for i, (rec, pieces) in enumerate(items)
             if len(pieces) == 1 and pieces[0][2] == 0 and pieces[0][1] >= rec.size]
    if whole:
        for (i, _, _), error in zip(whole, tier.read_many([(rec, addr) for _, rec, addr in whole]), strict=True):
            out[i] = error  # type: ignore[assignment]
    done = {i for i, _, _ in whole}
    for i, (rec, pieces) in enumerate(items):
        if i in done:
            continue
        with staging.borrow(max(rec.size, 1)) as region:
            try:
                tier.read_into(rec, region.address)
            except TidekvError as exc:
                out[i] = exc
                continue
            for address, length, offset in pieces:
                ctypes.memmove(address, region.address + offset, length)
    return out


class DiskServer:
    """A holder's disk server: answers ``DiskRead`` from readers on other hosts. Requests run one
    at a time on the server's thread (reads of one request in parallel on the tier's threads)."""

    def __init__(self, tier: DiskTier, engine: TransferEngine, staging: StagingArea, host: str,
                 secret: str | None, port: int = 0) -> None:
        self._tier = tier
        self._engine = engine
        self._staging = staging
        self.served = 0
        self._server = channel.Server(SPEC, host, port, self._handle, secret=secret)
        self.address = self._server.address

    def close(self) -> None:
        self._server.close()

    def _handle(self, body: DiskRead, peer: channel.Peer) -> list[int]:
        """Reads the records in rounds of at most MAX_BATCH_BYTES, each round's writes to the
        reader in flight while the next round is read."""
        out = [int(Outcome.MISSING)] * len(body.items)
        sending: tuple[contextlib.ExitStack, Any, list[int]] | None = None
        sending_size = 0
        try:
            for batch, size in self._rounds(body):
                if sending is not None and sending_size + size > self._staging.capacity:
                    self._sent(sending, out)  # both rounds cannot be staged at once: no overlap
                    sending = None
                stack = contextlib.ExitStack()
                try:
                    region = stack.enter_context(self._staging.borrow(max(size, 1)))
                    requests, owners = self._read(body, batch, region.address, out)
                except BaseException:
                    stack.close()
                    raise
                if sending is not None:
                    self._sent(sending, out)
                sending = (stack, self._send(requests, body.reader, owners, out), owners)
                sending_size = size
        finally:
            if sending is not None:
                self._sent(sending, out)
        self.served += sum(1 for o in out if o == Outcome.OK)
        return out

    def _rounds(self, body: DiskRead) -> Iterator[tuple[list[tuple[int, DiskRecord]], int]]:
        """The request's records of this holder, in rounds of at most MAX_BATCH_BYTES (staged)."""
        batch: list[tuple[int, DiskRecord]] = []
        size = 0
        for i, item in enumerate(body.items):
            rec = record_of(self._tier, item.disk, item.offset, item.key, item.token, item.size, item.crc)
            if rec is None:
                continue
            if batch and size + _staged(rec.size) > MAX_BATCH_BYTES:
                yield batch, size
                batch, size = [], 0
            batch.append((i, rec))
            size += _staged(rec.size)
        if batch:
            yield batch, size

    def _read(self, body: DiskRead, batch: list[tuple[int, DiskRecord]], base: int,
              out: list[int]) -> tuple[list[TransferRequest], list[int]]:
        """Reads one round into staging memory at ``base``, verified; returns the writes of the
        records read whole (and the item each belongs to)."""
        at, cursor = [], base
        for _, rec in batch:
            at.append(cursor)
            cursor += _staged(rec.size)
        errors = self._tier.read_many([(rec, addr) for (_, rec), addr in zip(batch, at, strict=True)])
        requests, owners = [], []
        for (i, rec), addr, error in zip(batch, at, errors, strict=True):
            if error is not None:
                out[i] = Outcome.CORRUPT if isinstance(error, DiskCorruptError) else Outcome.MISSING
                if not isinstance(error, DiskCorruptError):
                    logger.warning("disk server: reading a record of disk %s failed: %s", self._tier.ids[rec.disk],
                                   error)
                continue
            pieces = body.items[i].pieces
            if any(offset < 0 or length < 0 or offset + length > rec.size for _, length, offset in pieces):
                continue  # a piece outside the object: MISSING, nothing written
            out[i] = Outcome.OK
            for address, length, offset in pieces:
                requests.append(TransferRequest(TransferOp.WRITE, addr + offset, length, body.reader, address))
                owners.append(i)
        return requests, owners

    def _send(self, requests: list[TransferRequest], reader: str, owners: list[int], out: list[int]) -> Any:
        """Starts the writes of one round into the reader's memory; their handle, or None."""
        if not requests:
            return None
        try:
            return self._engine.transfer(requests)
        except TidekvError as exc:
            logger.warning("disk server: cannot write to reader %s: %s", reader, exc)
            for i in owners:
                out[i] = Outcome.UNSENT
            return None

    @staticmethod
    def _sent(sending: tuple[contextlib.ExitStack, Any, list[int]], out: list[int]) -> None:
        """Waits for one round's writes (a failed one: UNSENT), then frees its staging memory."""
        stack, handle, owners = sending
        try:
            if handle is not None:
                try:
                    handle.wait()
                except TidekvError:
                    for i, status in zip(owners, handle.statuses(), strict=True):
                        if status.state != TransferState.DONE:
                            out[i] = Outcome.UNSENT
        finally:
            stack.close()


class DiskReader:
    """Reads disk-only objects for one Store: its own disks directly, others' through their
    holders' disk servers (one channel per server, kept)."""

    def __init__(self, engine: TransferEngine, staging: StagingArea, timeout_s: float, secret: str | None,
                 tier: DiskTier | None = None) -> None:
        self._engine = engine
        self._staging = staging
        self._timeout_s = timeout_s
        self._secret = secret
        self.tier = tier
        self._clients: dict[str, channel.Client] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, {}
        for client in clients.values():
            client.close()

    def read(self, keys: list[bytes], copies: list[p.DiskCopy], sizes: list[int],
             pieces: list[Pieces]) -> list[Exception | None]:
        """Reads each object's disk copy into its pieces; per key None or why it failed."""
        out: list[Exception | None] = [None] * len(keys)
        local: list[int] = []
        remote: dict[str, list[int]] = {}
        for i, copy in enumerate(copies):
            if self.tier is not None and copy.engine == self._engine.name and copy.disk in self.tier.ids:
                local.append(i)
            else:
                remote.setdefault(copy.address, []).append(i)
        if local:
            items = []
            for i in local:
                c = copies[i]
                rec = record_of(self.tier, c.disk, c.offset, keys[i], c.token, sizes[i], c.crc)  # type: ignore[arg-type]
                items.append((rec, pieces[i]))
            for i, error in zip(local, read_local(self.tier, self._staging, items), strict=True):  # type: ignore[arg-type]
                out[i] = error
        for address, mine in remote.items():
            request = DiskRead(self._engine.name, [
                DiskReadItem(copies[i].disk, copies[i].offset, keys[i], copies[i].token, sizes[i], copies[i].crc,
                             pieces[i]) for i in mine])
            try:
                outcomes = self._client(address).call(request)
            except TidekvError as exc:
                for i in mine:
                    out[i] = exc
                continue
            for i, outcome in zip(mine, outcomes, strict=True):
                out[i] = _error(outcome, keys[i], copies[i])
        return out

    def _client(self, address: str) -> channel.Client:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = channel.Client(address, SPEC, self._timeout_s, secret=self._secret)
            return client


def _error(outcome: int, key: bytes, copy: p.DiskCopy) -> Exception | None:
    if outcome == Outcome.OK:
        return None
    if outcome == Outcome.CORRUPT:
        return DiskCorruptError(f"the copy of {key[:64]!r} on disk {copy.disk} failed its checksum: a miss")
    if outcome == Outcome.UNSENT:
        return StoreError(f"the holder of disk {copy.disk} read {key[:64]!r} but could not write it into this "
                          "reader's memory (can the holder's engine reach this one?)")
    return ObjectNotFoundError(f"disk {copy.disk} no longer holds {key[:64]!r}", key=key)
