"""The prefill -> decode hand-off of held KV blocks: which blocks move, who holds what, and
the "release" signal.

The decode side pulls the prefill blocks that hold the prompt tokens it does not have
(``pull_end``, ``pulled_blocks``). The prefill side holds a finished request's blocks until it
is told to release them, or until ``hold_timeout_s`` passes (the last resort: a decode that
never comes leaks nothing for longer). Releases travel over one ZeroMQ DEALER -> ROUTER channel
per prefill rank, as ``HoldRelease`` messages (versioned with the PD contract), and say why
(``ReleaseReason``): the decode pulled the blocks (its worker says so), its pull failed (its
worker), the decode request ended before any pull was planned (its scheduler, e.g. aborted when
its client left), or the decode leg failed before the decode took the request (the proxy:
decode unreachable or answering an error). ``HoldTable`` owns the ROUTER end on the prefill
worker and ``Releaser`` a DEALER end wherever a release is sent from. Each does its ZeroMQ I/O on
a thread of its own: a step never waits on a socket.

A forged release would free blocks a decode is still reading (wrong tokens), so with a shared
secret the channel is authenticated (``tidekv.auth``, label "pd"): a releaser greets each hold
table once, checks its proof, and seals every release with the session's key; the hold table
drops (and logs) a release that is not sealed by a live session, or replayed. Without a secret
on either side releases go plain, one message each, as before; a side with a secret refuses a
side without. Neighbours: ``contract`` (the hold table's address travels in
``RankEndpoint.confirm_address``; ``PROTOCOL_VERSION``).
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time

import msgspec
import zmq

from tidekv import auth
from tidekv.auth import ClientHandshake, Sealer, ServerHandshake
from tidekv.errors import AuthenticationError, ConfigError
from tidekv.kvcache.contract import PROTOCOL_VERSION, KVHandoff
from tidekv.logs import WarnEvery
from tidekv.values import format_host_port

logger = logging.getLogger(__name__)


class ReleaseReason(enum.Enum):
    """Why a prefill may free a request's held blocks now."""

    PULLED = "pulled"  #: the decode rank pulled them (sent by the decode worker)
    PULL_FAILED = "pull_failed"  #: the decode rank's pull failed and finished; it recomputes or fails
    DECODE_ENDED = "decode_ended"  #: the decode request ended before a pull was planned (e.g. aborted)
    DECODE_FAILED = "decode_failed"  #: the decode never took the request, or answered an error (the proxy)


class HoldRelease(msgspec.Struct, frozen=True, array_like=True):
    """The one message of the hold channel: "free request ``request_id``'s blocks, because ``reason``"."""

    protocol_version: int
    """The sender's ``contract.PROTOCOL_VERSION``; a hold table drops (and names) any other."""
    request_id: str
    """The prefill's id of the request (``KVHandoff.request_id``)."""
    reason: ReleaseReason
    detail: str = ""
    """What happened, for the prefill's log (e.g. the proxy's error for a failed decode)."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(HoldRelease).decode
_MAX_UNPAIRED = 4096
"""Releases kept without a matching hold before the stale ones (older than the hold timeout)
are pruned. A release may come before its hold (the proxy can hear of a failed decode before
the prefill's worker has recorded the hold), and after it (a second sender, e.g. the proxy's
backstop after the decode's own release)."""
_MAX_SESSIONS = 4096
"""Releasers' sessions a hold table keeps (the least recently used goes first)."""
_RETRY_HANDSHAKE_S = 10.0
"""A hold table whose handshake failed is not greeted again for this long (its releases are
dropped meanwhile, and free at their deadline), so one dead prefill does not stall the others."""


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

    A receiver thread reads the releases as they arrive, so a step never touches ZeroMQ: on this
    2-vCPU VM the first poll/recv after the process slept costs 0.1-0.25 ms, paid inside the
    prefill's step when the step read the socket itself. ``hold``, ``released``, ``wait`` and
    ``is_held`` may be called from any thread (the worker's step thread calls them).
    """

    def __init__(self, host: str, hold_timeout_s: float, secret: str | None = None, port: int = 0) -> None:
        self.hold_timeout_s = hold_timeout_s
        self._secret = secret
        self._sessions: collections.OrderedDict[bytes, Sealer] = collections.OrderedDict()
        self._refused = WarnEvery()
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # (IPv4 addresses work as before)
        try:
            if port:
                sock.bind(f"tcp://{format_host_port(host, port)}")
            else:
                port = sock.bind_to_random_port(f"tcp://{format_host_port(host, 0).rpartition(':')[0]}")
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"the PD hold table cannot listen on {format_host_port(host, port)}: {exc} "
                              "(hold_port, engine_host)") from None
        self.address = format_host_port(host, port)
        # close() wakes the receiver through its own inproc pair (a peer cannot send on it).
        stop_endpoint = f"inproc://tidekv-holds-{id(self):x}-{port}"
        stop_rx = ctx.socket(zmq.PAIR)
        stop_rx.bind(stop_endpoint)
        self._stop_tx = ctx.socket(zmq.PAIR)
        self._stop_tx.setsockopt(zmq.LINGER, 0)
        self._stop_tx.connect(stop_endpoint)
        self._deadlines: dict[str, float] = {}
        # request -> (arrival, the release), until released() pairs it with a hold
        self._releases: dict[str, tuple[float, HoldRelease]] = {}
        self._bad_version = WarnEvery()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._receive_loop, args=(sock, stop_rx), name="tidekv-holds",
                                        daemon=True)
        self._thread.start()

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
        if self._thread.is_alive():
            self._stop_tx.send(b"")
            self._thread.join(timeout=5)
        self._stop_tx.close(linger=0)

    def _any_released(self) -> bool:
        return any(r in self._releases for r in self._deadlines)

    def _receive_loop(self, sock: zmq.Socket, stop: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while stop not in dict(poller.poll()):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 2:
                        continue
                    try:
                        reply = self._receive(frames[1])
                    except Exception:  # noqa: BLE001 - one peer's message must not stop the receiver
                        logger.exception("hold table %s: a message failed; receiving on", self.address)
                        continue
                    if reply is not None:
                        sock.send_multipart([frames[0], reply], zmq.NOBLOCK)
        except zmq.ContextTerminated:
            pass  # the process is shutting down
        except Exception:
            logger.exception("the hold-release receiver stopped; held blocks now free only at their deadline")
        finally:
            sock.close(linger=0)
            stop.close(linger=0)

    def _receive(self, frame: bytes) -> bytes | None:
        """Takes one message; returns the reply to send back (a handshake's Challenge), if any."""
        message = auth.decode_any(frame)  # None: a plain release
        if isinstance(message, auth.Greeting):
            return self._greeted(frame)
        if isinstance(message, auth.Sealed):
            sealer = self._sessions.get(message.session)
            if sealer is None:
                self._refuse("a release sealed by an unknown session (this prefill restarted, or forgot the "
                             "session among too many)")
                return None
            try:
                frame = sealer.open(message)
            except AuthenticationError as exc:
                self._refuse(str(exc))
                return None
            self._sessions.move_to_end(message.session)
        elif self._secret is not None:
            self._refuse("an unauthenticated release (the sender has no TIDEKV_SECRET, or an older tidekv)")
            return None
        self._release(frame)
        return None

    def _greeted(self, frame: bytes) -> bytes | None:
        handshake = ServerHandshake(self._secret, "pd", f"hold table {self.address}'s peer")
        try:
            challenge = handshake.greeted(frame)
        except AuthenticationError as exc:
            self._refuse(str(exc))
            return None
        if self._secret is not None:
            self._sessions[handshake.nonce] = Sealer(handshake.session_key(), handshake.nonce, "a releaser")
            while len(self._sessions) > _MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return challenge

    def _refuse(self, why: str) -> None:
        held_back = self._refused.due()
        if held_back is not None:
            logger.warning("hold table %s dropped %s; its blocks free at their deadline (%d similar not logged)",
                           self.address, why, held_back)

    def _release(self, frame: bytes) -> None:
        try:
            release = _decode(frame)
        except msgspec.DecodeError:
            version = _peek_version(frame)
            if version is None or version == PROTOCOL_VERSION:
                logger.warning("dropped a malformed hold-release message on %s", self.address)
                return
            release = HoldRelease(version, "?", ReleaseReason.PULLED)
        if release.protocol_version != PROTOCOL_VERSION:
            held_back = self._bad_version.due()
            if held_back is not None:
                logger.warning("dropped a hold release of tidekv PD protocol version %s on %s (this prefill speaks "
                               "version %d): run the same tidekv release on every instance and the proxy (%d similar "
                               "not logged)", release.protocol_version, self.address, PROTOCOL_VERSION, held_back)
            return
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


def _peek_version(frame: bytes) -> int | None:
    """The protocol version a hold message of another layout claims (its first field), if any."""
    try:
        fields = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    return fields[0] if isinstance(fields, list) and fields and isinstance(fields[0], int) else None


class Releaser:
    """Sends ``HoldRelease`` messages to prefill hold tables (decode workers and schedulers, the proxy).

    ``release`` only queues the message: a sender thread puts it on the wire, so the step that
    pulled the blocks (or the proxy's event loop) does not also pay for waking ZeroMQ's I/O
    thread (~0.1-0.25 ms on a 2-vCPU VM). The prefill frees the blocks a moment later; nothing
    waits for that. Thread-safe.
    """

    def __init__(self, secret: str | None = None, handshake_timeout_s: float = 5.0) -> None:
        self._secret = secret
        self._handshake_timeout_s = handshake_timeout_s
        self._sealers: dict[str, Sealer | None] = {}  # the session with each hold table (None: no secret)
        self._down_until: dict[str, float] = {}  # hold tables whose handshake failed: not greeted again until
        self._socks: dict[str, zmq.Socket] = {}
        self._queue: queue.SimpleQueue[tuple[str, HoldRelease] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_loop, name="tidekv-release", daemon=True)
        self._thread.start()

    def release(self, address: str, request_id: str, reason: ReleaseReason = ReleaseReason.PULLED,
                detail: str = "") -> None:
        """Queues "free ``request_id``'s blocks" for the hold table at ``address`` ("host:port")."""
        self._queue.put((address, HoldRelease(PROTOCOL_VERSION, request_id, reason, detail)))

    def release_handoff(self, handoff: KVHandoff, reason: ReleaseReason, detail: str = "") -> None:
        """Queues the release of ``handoff``'s hold on every prefill rank that holds its blocks."""
        for rank in handoff.ranks:
            if rank.confirm_address:
                self.release(rank.confirm_address, handoff.request_id, reason, detail)

    def _send_loop(self) -> None:
        try:
            self._send_all()
        finally:  # the sockets are this thread's: closed here, never under a poll of it
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()

    def _send_all(self) -> None:
        while (item := self._queue.get()) is not None:
            address, release = item
            sock = self._socks.get(address)
            if sock is None:
                sock = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.setsockopt(zmq.IPV6, 1)
                sock.connect(f"tcp://{address}")
                self._socks[address] = sock
            message = _encode(release)
            try:
                sealer = self._session(address, sock)
            except (AuthenticationError, TimeoutError) as exc:
                self._down_until[address] = time.monotonic() + _RETRY_HANDSHAKE_S
                logger.warning("could not release request %s at %s: %s; it frees at its deadline",
                               release.request_id, address, exc)
                continue
            if sealer is not None:
                message = sealer.seal(message)
            try:
                sock.send(message, zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("could not release request %s at %s (queue full); it frees at its deadline",
                               release.request_id, address)

    def _session(self, address: str, sock: zmq.Socket) -> Sealer | None:
        """The session with the hold table at ``address`` (its sealer; None without a secret),
        greeting it first if need be: once per hold table, on this thread, never on a step.

        Raises:
            AuthenticationError: the hold table did not prove the secret, or wants one we lack.
            TimeoutError: it did not answer within handshake_timeout_s (or did not recently).
        """
        if address in self._sealers:
            return self._sealers[address]
        if time.monotonic() < self._down_until.get(address, 0.0):
            raise TimeoutError(f"its handshake failed less than {_RETRY_HANDSHAKE_S:.0f} s ago")
        handshake = ClientHandshake(self._secret, "pd", f"hold table {address}")
        sock.send(handshake.greeting())
        if not sock.poll(int(self._handshake_timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"hold table {address} did not answer its handshake within "
                               f"{self._handshake_timeout_s} s")
        handshake.challenged(sock.recv())
        self._sealers[address] = handshake.sealer
        return handshake.sealer

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self._handshake_timeout_s + 5)
