"""Churn: one client's put/get/remove/upsert load on its own keys, with the books to prove what
survived (``tidekv bench failover`` and the store's failover tests).

Each client owns the keys ``{prefix}/{i}``; every value is ``value(key, version)``, so a read
names the version it saw. The books track, per key, what the last *acknowledged* write left
(a version, or absent) and, after a write that failed, that either outcome is allowed until the
next acknowledged write. A read that returns a version other than the acknowledged one (or an
object that was acknowledged removed) is a stale read; ``verify`` reads every key afterwards
and counts acknowledged objects that are gone or differ (lost). The clock of every success is
kept, so the longest gap around a failover can be measured.
Neighbours: ``failover`` (the bench), ``tests/store/agent_main`` (the test driver).
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

from tidekv.errors import LeaseExpiredError, ObjectNotFoundError, TidekvError

ABSENT = -1
"""Version of a key that holds no object."""


def value(key: str, version: int, size: int) -> bytes:
    """The bytes of ``key`` at ``version``: a header naming both, then a pattern derived from them."""
    head = f"{key}#{version}#".encode()
    seed = hashlib.blake2b(head, digest_size=8).digest()
    body = (seed * (size // 8 + 1))[: max(0, size - len(head))]
    return head + body


def version_of(key: str, data: bytes, size: int) -> int | None:
    """The version ``data`` is a whole copy of, None if it is not a whole value of ``key``."""
    try:
        name, version, _ = data.split(b"#", 2)
        v = int(version)
    except ValueError:
        return None
    return v if name.decode() == key and data == value(key, v, size) else None


@dataclass
class Books:
    acked: dict[str, int] = field(default_factory=dict)  # key -> version (ABSENT) after the last acked write
    uncertain: dict[str, set[int]] = field(default_factory=dict)  # key -> versions also allowed
    successes: list[float] = field(default_factory=list)  # monotonic time of each success
    ops: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    stale_reads: int = 0
    stale_examples: list[str] = field(default_factory=list)  # the first few, for the report
    put_s: list[float] = field(default_factory=list)
    get_s: list[float] = field(default_factory=list)

    def allowed(self, key: str) -> set[int]:
        return {self.acked.get(key, ABSENT)} | self.uncertain.get(key, set())

    def wrote(self, key: str, version: int) -> None:
        self.acked[key] = version
        self.uncertain.pop(key, None)

    def failed(self, key: str, version: int, exc: BaseException) -> None:
        self.uncertain.setdefault(key, set()).add(version)
        self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1

    def summary(self) -> dict[str, Any]:
        gaps = [b - a for a, b in zip(self.successes, self.successes[1:])]
        return {"acknowledged": sum(1 for v in self.acked.values() if v != ABSENT), "ops": self.ops,
                "errors": self.errors, "stale_reads": self.stale_reads, "stale_examples": self.stale_examples,
                "max_gap_s": max(gaps, default=0.0)}

    def stale(self, key: str, seen: int | None) -> None:
        self.stale_reads += 1
        if len(self.stale_examples) < 10:
            self.stale_examples.append(f"{key}: read {'torn bytes' if seen is None else seen}, expected one of "
                                       f"{sorted(self.allowed(key))} at {time.monotonic():.3f}")


def churn(store: Any, prefix: str, duration_s: float, *, keys: int = 200, size: int = 4096, seed: int = 0,
          books: Books | None = None) -> Books:
    """Runs the mixed load on ``store`` for ``duration_s``; returns the books."""
    rng = random.Random(seed)
    books = books if books is not None else Books()
    versions: dict[str, int] = {}
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        key = f"{prefix}/{rng.randrange(keys)}"
        roll = rng.random()
        kind = "get" if roll < 0.5 else "write" if roll < 0.9 else "remove"
        books.ops[kind] = books.ops.get(kind, 0) + 1
        started = time.monotonic()
        try:
            if kind == "get":
                _read(store, books, key, size)
                books.get_s.append(time.monotonic() - started)
            elif kind == "remove":
                try:
                    store.remove(key, force=True)
                except ObjectNotFoundError:
                    pass
                books.wrote(key, ABSENT)
            else:
                # put where the key is surely absent (a put of a present key is a no-op), else upsert
                version = versions[key] = versions.get(key, 0) + 1
                is_new = books.allowed(key) == {ABSENT}
                try:
                    (store.put if is_new else store.upsert)(key, value(key, version, size))
                except TidekvError as exc:
                    books.failed(key, version, exc)
                    continue
                books.wrote(key, version)
                books.put_s.append(time.monotonic() - started)
        except TidekvError as exc:
            if kind == "remove":
                books.uncertain.setdefault(key, set()).add(ABSENT)
            books.errors[type(exc).__name__] = books.errors.get(type(exc).__name__, 0) + 1
            continue
        books.successes.append(time.monotonic())
    return books


def _read(store: Any, books: Books, key: str, size: int) -> None:
    try:
        data = store.get(key)
    except ObjectNotFoundError:
        seen = ABSENT
    except LeaseExpiredError:
        return
    else:
        v = version_of(key, data, size)
        if v is None:
            books.stale(key, None)  # torn or foreign bytes: the worst kind
            return
        seen = v
    if seen in books.allowed(key):
        if books.uncertain.get(key):
            books.wrote(key, seen)  # the read settles it
    else:
        books.stale(key, seen)


def verify(store: Any, books: Books, size: int = 4096) -> dict[str, int]:
    """Reads every key once more: acknowledged objects lost or changed, and stale answers."""
    lost = stale = 0
    for key in books.acked:
        try:
            data = store.get(key)
        except ObjectNotFoundError:
            seen = ABSENT
        else:
            v = version_of(key, data, size)
            seen = -2 if v is None else v
        if seen in books.allowed(key):
            continue
        if books.acked[key] != ABSENT and seen == ABSENT:
            lost += 1
        else:
            stale += 1
    return {"lost": lost, "stale": stale}
