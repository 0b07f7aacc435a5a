"""The prefill -> decode hand-off of held KV blocks: which blocks move, who holds what, and
the "release" signal.

The decode pulls the prefill blocks holding the prompt tokens it lacks (``pull_end``,
``pulled_blocks``). The prefill holds a finished request's blocks until released or until
``hold_timeout_s``. Releases are one-way ``HoldRelease`` messages (with a ``ReleaseReason``) on
the hold channel (``tidekv.channel``, label "pd", versioned with the PD contract), one connection
per prefill rank; ``HoldTable`` serves it on the prefill worker, ``Releaser`` sends, each on its
own thread. With a shared secret both sides authenticate (``tidekv.auth``) before a release is
taken. Neighbours: ``contract`` (the hold table's address travels in
``RankEndpoint.confirm_address``; ``PROTOCOL_VERSION``).
Design notes: docs/design-kvcache.md#tidekvkvcachehandoff
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time

import msgspec
from tidekv.channel import Client, DownUntil, Peer, Server, Spec
from tidekv.errors import ConfigError, PeerUnavailableError, TidekvError
from tidekv.kvcache.contract import PROTOCOL_VERSION, KVHandoff
from tidekv.logs import WarnEvery

logger = logging.getLogger(__name__)


class ReleaseReason(enum.Enum):
    """Why a prefill may free a request's held blocks now."""

    PULLED = "pulled"  #: the decode rank pulled them (sent by the decode worker)
    PULL_FAILED = "pull_failed"  #: the decode rank's pull failed and finished; it recomputes or fails
    DECODE_ENDED = "decode_ended"  #: the decode request ended before a pull was planned (e.g. aborted)
    DECODE_FAILED = "decode_failed"  #: the decode never took the request, or answered an error (the proxy)


class HoldRelease(msgspec.Struct, frozen=True, array_like=True, tag="release"):
    """The one message of the hold channel: "free request ``request_id``'s blocks, because ``reason``"."""

    request_id: str
    """The prefill's id of the request (``KVHandoff.request_id``)."""
    reason: ReleaseReason
    detail: str = ""
    """What happened, for the prefill's log (e.g. the proxy's error for a failed decode)."""


MAGIC = b"tkp\x03"
"""First bytes a releaser sends on a new connection to a hold table."""
SPEC = Spec(label="pd", magic=MAGIC, version=PROTOCOL_VERSION, body=HoldRelease, server_name="hold table",
            unavailable=lambda message, sent: PeerUnavailableError(message))
"""The hold channel (``tidekv.channel``): one-way releases, versioned with the PD contract."""
_MAX_UNPAIRED = 4096
"""Releases kept without a matching hold before the stale ones (older than the hold timeout)
are pruned. A release may come before its hold (the proxy can hear of a failed decode before
the prefill's worker has recorded the hold), and after it (a second sender, e.g. the proxy's
backstop after the decode's own release)."""


def pull_end(prompt_len: int, remote_num_tokens: int, num_remote_blocks: int, block_size: int, *,
             is_sync: bool) -> int:
    """How many prompt tokens (from the first) a decode can take from a prefill's held blocks.

    A synchronous pull stops one token short of the prompt: the step that loads the KV must
    still compute a token to sample from (vLLM refuses a step with nothing to compute). An
    asynchronous pull may take every token; the engine recomputes the last one afterwards.

    Args:
        prompt_len: tokens of the decode's prompt.
        remote_num_tokens: tokens the prefill computed into its blocks.
        num_remote_blocks: blocks the prefill holds for the request.
        block_size: tokens per block (equal on both sides: the layouts match).
    """
    end = prompt_len - 1 if is_sync else prompt_len
    return max(0, min(end, remote_num_tokens, num_remote_blocks * block_size))


def pulled_blocks(end_token: int, num_pulled_tokens: int, block_size: int) -> slice:
    """Positions (in the request's block list, the same on both sides) of the blocks holding
    prompt tokens ``[end_token - num_pulled_tokens, end_token)``.

    The first pulled token starts a block (vLLM hands connectors a block-aligned local hit),
    so no pulled block holds tokens computed here; the last block may be partial (the tokens
    after ``end_token`` are written by this engine's own forward, after the pull).
    """
    start = max(0, end_token - num_pulled_tokens)
    return slice(start // block_size, -(-end_token // block_size))


class HoldTable:
    """Prefill side: held requests, released when told (``HoldRelease``) or at their deadline.

    The channel's thread takes the releases as they arrive, so a step never touches a socket.
    ``hold``, ``released``, ``wait`` and ``is_held`` may be called from any thread (the worker's
    step thread calls them).

    Raises:
        ConfigError: the port cannot be bound.
    """

    def __init__(self, host: str, hold_timeout_s: float, secret: str | None = None, port: int = 0) -> None:
        self.hold_timeout_s = hold_timeout_s
        self._deadlines: dict[str, float] = {}
        # request -> (arrival, the release), until released() pairs it with a hold
        self._releases: dict[str, tuple[float, HoldRelease]] = {}
        self._cond = threading.Condition()
        try:
            self._server = Server(SPEC, host, port, self._received, secret=secret)
        except ConfigError as exc:
            raise ConfigError(f"the PD hold table: {exc} (hold_port, engine_host)") from None
        self.address = self._server.address

    def hold(self, request_id: str) -> None:
        with self._cond:
            self._deadlines[request_id] = time.monotonic() + self.hold_timeout_s
            if request_id in self._releases:
                self._cond.notify_all()  # released before its hold was recorded

    def released(self) -> set[str]:
        """Requests whose blocks may be freed now (released, or past their deadline). A release
        for a failed or ended decode is logged at INFO, a deadline at WARNING."""
        if not self._deadlines:  # every step of every engine asks: no lock while nothing is held
            return set()
        with self._cond:
            now = time.monotonic()
            out = {r for r in self._deadlines if r in self._releases}
            for r in out:
                release = self._releases.pop(r)[1]
                if release.reason is not ReleaseReason.PULLED:
                    logger.info("request %s: freeing its held KV blocks now (%s%s)", r, release.reason.value,
                                f": {release.detail}" if release.detail else "")
            expired = {r for r, t in self._deadlines.items() if t <= now and r not in out}
            for r in expired:
                logger.warning("request %s: decode did not pull its KV within %.1f s; freeing the blocks",
                               r, self.hold_timeout_s)
            out |= expired
            for r in out:
                del self._deadlines[r]
            return out

    def wait(self, timeout_s: float) -> bool:
        """Sleeps until a held request is released or ``timeout_s`` passes; True if one is."""
        with self._cond:
            return self._cond.wait_for(self._any_released, max(0.0, timeout_s))

    @property
    def pending(self) -> int:
        return len(self._deadlines)

    def is_held(self, request_id: str) -> bool:
        """Whether ``request_id``'s blocks are held (not yet released by ``released()``)."""
        return request_id in self._deadlines

    def close(self) -> None:
        self._server.close()

    def _any_released(self) -> bool:
        return any(r in self._releases for r in self._deadlines)

    def _received(self, release: HoldRelease, peer: Peer) -> None:
        self._record(release)

    def _record(self, release: HoldRelease) -> None:
        with self._cond:
            now = time.monotonic()
            self._releases.setdefault(release.request_id, (now, release))  # the first reason counts
            if len(self._releases) > _MAX_UNPAIRED:
                # Releases whose hold never came or was gone already (a restarted prefill, a
                # second sender): a real one is paired within a step or two, so old ones go.
                for r, (t, _) in list(self._releases.items()):
                    if now - t > self.hold_timeout_s and r not in self._deadlines:
                        del self._releases[r]
            if release.request_id in self._deadlines:
                self._cond.notify_all()



class Releaser:
    """Sends ``HoldRelease`` messages to prefill hold tables (decode workers and schedulers, the proxy).

    ``release`` only queues the message: a sender thread puts it on the wire (one connection per
    hold table, made and authenticated on first use), so the step that pulled the blocks (or the
    proxy's event loop) never waits on a socket. The prefill frees the blocks a moment later;
    nothing waits for that. A hold table that cannot be reached is not tried again before its
    backoff passes (``channel.Backoff``); its releases are dropped meanwhile and its blocks free
    at their deadline, so one dead prefill does not stall the others. Thread-safe.
    """

    def __init__(self, secret: str | None = None, handshake_timeout_s: float = 5.0) -> None:
        self._secret = secret
        self._handshake_timeout_s = handshake_timeout_s
        self._clients: dict[str, Client] = {}
        self._down = DownUntil()
        self._dropped = WarnEvery()
        self._queue: queue.SimpleQueue[tuple[str, HoldRelease] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_loop, name="tidekv-release", daemon=True)
        self._thread.start()

    def release(self, address: str, request_id: str, reason: ReleaseReason = ReleaseReason.PULLED,
                detail: str = "") -> None:
        """Queues "free ``request_id``'s blocks" for the hold table at ``address`` ("host:port")."""
        self._queue.put((address, HoldRelease(request_id, reason, detail)))

    def release_handoff(self, handoff: KVHandoff, reason: ReleaseReason, detail: str = "") -> None:
        """Queues the release of ``handoff``'s hold on every prefill rank that holds its blocks."""
        for rank in handoff.ranks:
            if rank.confirm_address:
                self.release(rank.confirm_address, handoff.request_id, reason, detail)

    def _send_loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                self._send(*item)
        finally:  # the connections are this thread's: closed here
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def _send(self, address: str, release: HoldRelease) -> None:
        if not self._down.due(address):
            held_back = self._dropped.due()
            if held_back is not None:
                logger.warning("could not release request %s at %s: it failed recently; it frees at its deadline "
                               "(%d similar not logged)", release.request_id, address, held_back)
            return
        client = self._clients.get(address)
        try:
            if client is None:
                client = self._clients[address] = Client(address, SPEC, self._handshake_timeout_s, secret=self._secret)
            client.send(release)
        except TidekvError as exc:
            delay = self._down.failed(address)
            logger.warning("could not release request %s at %s: %s; it frees at its deadline (next try in %.1f s)",
                           release.request_id, address, exc, delay)
            return
        self._down.ok(address)

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self._handshake_timeout_s + 5)
