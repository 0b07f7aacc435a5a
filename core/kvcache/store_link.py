"""A KV connector's link to the store master: connected when it can be, retried in the
background with backoff when it cannot, so that prefix reuse turns itself back on.

An engine started while its master is down, or whose master goes away, keeps serving by
recomputing prompts; ``StoreLink.store`` is None meanwhile, so no request waits on a master that
does not answer. A background thread retries (``Backoff``: 0.5 s, doubling, at most 10 s between
attempts): it connects a client that never connected, or asks a client that lost its master
once more (the client itself re-registers with a restarted master, see ``Store``'s heartbeat).
The link logs once when reuse turns off (WARNING) and once when it turns on again (INFO).

Users call ``lost(exc)`` when a store call failed because the master did not answer
(``MasterUnavailableError``); other failures (a transfer to a peer, a missing object) leave the
link up. ``try_now()`` makes one attempt at once, for a caller that has news the master answers
(a vLLM worker told to load blocks the scheduler just found in the store must not wait for its
own backoff: a load that finds no client fails its request). Thread-safe. Neighbours: ``tidekv.store.Store`` (the client it holds), the vLLM plugin's
scheduler and worker (one link each).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tidekv.channel import Backoff
from tidekv.errors import MasterUnavailableError, TidekvError

logger = logging.getLogger(__name__)

PROBE_KEY = "tidekv/link-probe"
"""Key the link asks the master about to see whether it answers (one round trip, no lease)."""


class StoreClient(Protocol):
    """What the link needs of a store client (``tidekv.store.Store`` is one)."""

    def exists_many(self, keys: Any) -> list[bool]: ...

    def exists_leased(self, keys: Any) -> list[bool]: ...

    def close(self) -> None: ...


class LinkState(enum.Enum):
    UP = "up"  #: the master answered last time: ``store`` is the client
    DOWN = "down"  #: never connected, or lost: ``store`` is None, the retry thread works
    CLOSED = "closed"  #: ``close()`` was called


class StoreLink:
    """One component's store client (``owner`` names it in the log, e.g. "scheduler", "rank 0").

    The first connection attempt runs in the constructor (so that a master that is up serves the
    very first requests); if it fails, the retry thread takes over.

    Args:
        master: the master's "host:port" (for the log).
        connect: makes a connected client; raises TidekvError when the master does not answer.
        owner: which component this is, for the log.
        backoff: delays between attempts.
    """

    def __init__(self, master: str, connect: Callable[[], StoreClient], *, owner: str,
                 backoff: Backoff | None = None) -> None:
        self.master = master
        self.owner = owner
        self.backoff = backoff if backoff is not None else Backoff()
        self._connect = connect
        self._client: StoreClient | None = None
        self._state = LinkState.DOWN
        self._cond = threading.Condition()
        self._attempt = threading.Lock()  # one connection attempt at a time (retry thread or try_now)
        self._last_attempt = float("-inf")
        self._thread: threading.Thread | None = None
        self._last_attempt = time.monotonic()
        try:
            self._client = connect()
        except TidekvError as exc:
            with self._cond:
                self._went_down(exc, "unreachable")
        else:
            self._state = LinkState.UP
            logger.info("tidekv store at %s: connected (%s); prefix reuse is on", master, owner)

    @property
    def store(self) -> Any:
        """The client while the master answers, else None (reuse is off: recompute)."""
        return self._client if self._state is LinkState.UP else None

    @property
    def state(self) -> LinkState:
        return self._state

    def lost(self, exc: BaseException) -> None:
        """A store call failed with ``exc``: a master that did not answer turns reuse off until
        it answers again; any other error is not the link's business."""
        if isinstance(exc, MasterUnavailableError):
            with self._cond:
                if self._state is LinkState.UP:
                    self._went_down(exc, "stopped answering")

    def try_now(self) -> Any:
        """The client, after one attempt at once if the link is down and none was made in the
        last ``backoff.initial_s`` (so a master that stays down costs callers little); None if
        the master still does not answer or the link is closed."""
        if self._state is LinkState.UP:
            return self._client
        with self._attempt:
            if self._state is LinkState.DOWN and time.monotonic() - self._last_attempt >= self.backoff.initial_s:
                self._attempt_once()
        return self.store

    def wait_up(self, timeout_s: float) -> bool:
        """Blocks until the link is up (or ``timeout_s`` passes); True if it is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._state is not LinkState.DOWN, timeout_s) \
                and self._state is LinkState.UP

    def close(self) -> None:
        """Stops retrying and closes the client. Idempotent."""
        with self._cond:
            self._state = LinkState.CLOSED
            self._cond.notify_all()
            client, self._client = self._client, None
        if self._thread is not None:
            self._thread.join(timeout=30)
        if client is not None:
            client.close()

    # ---- internals ----------------------------------------------------------------------

    def _went_down(self, exc: BaseException, how: str) -> None:
        """Turns reuse off and wakes (or starts) the retry thread; the caller holds the lock."""
        self._state = LinkState.DOWN
        self._cond.notify_all()
        logger.warning("tidekv store at %s %s (%s): prefix reuse is off (%s), prompts are recomputed; "
                       "retrying in the background", self.master, how, exc, self.owner)
        if self._thread is None:
            self._thread = threading.Thread(target=self._retry_loop, name=f"tidekv-store-link-{self.owner}",
                                            daemon=True)
            self._thread.start()

    def _retry_loop(self) -> None:
        """Sleeps while the link is up; while it is down, tries again after each backoff delay."""
        failures = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._state is not LinkState.UP)
                if self._cond.wait_for(lambda: self._state is LinkState.CLOSED, self.backoff.delay_s(failures)):
                    return
            with self._attempt:
                if self._state is LinkState.CLOSED:
                    return
                failures = 0 if self._state is LinkState.UP or self._attempt_once() else failures + 1

    def _attempt_once(self) -> bool:
        """Connects (or asks the client already made) once; True and the link up if the master
        answered. The caller holds ``_attempt``."""
        self._last_attempt = time.monotonic()
        known = client = self._client
        try:
            if client is None:
                client = self._connect()
            else:
                client.exists_many([PROBE_KEY])
        except TidekvError as exc:
            logger.debug("tidekv store at %s still unreachable (%s): %s", self.master, self.owner, exc)
            return False
        with self._cond:
            if self._state is LinkState.CLOSED:
                if client is not known:  # connected just as close() ran: close() did not see it
                    client.close()
                return False
            self._client = client
            self._state = LinkState.UP
            # Logged before a waiter can run: one that saw the link up also finds the line.
            logger.info("tidekv store at %s answers again: prefix reuse is on (%s)", self.master, self.owner)
            self._cond.notify_all()
        return True


def lookup_client(master: str, client_id: str, timeout_s: float, secret: str | None) -> Any:
    """A connected master client (``Pool``: every group of a sharded pool) for an engine
    scheduler's lookups: no transfer engine or staging,
    TLS as ``TIDEKV_TLS_*`` say (``TlsConfig``). Lookups sit on the scheduling path: one attempt
    each (a master that does not answer fast is skipped; the link retries in the background and
    follows a new leader). Every engine plugin's scheduler connects through this one function.

    Raises:
        whatever ``MasterClient.connect`` raises (the link logs it and retries).
    """
    from tidekv.config import TlsConfig
    from tidekv.store.client.pool import Pool

    client = Pool(master, client_id, timeout_s=timeout_s, secret=secret, tls=TlsConfig.from_env())
    try:
        client.connect()
    except BaseException:
        client.close()
        raise
    return client
