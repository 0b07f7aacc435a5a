"""The prefill -> decode hand-off of held KV blocks: which blocks move, who holds what, and
the "done" signal.

The decode side pulls the prefill blocks that hold the prompt tokens it does not have
(``pull_end``, ``pulled_blocks``). The prefill side holds a finished request's blocks until the
decode side confirms it pulled them, or until a deadline passes (a decode that never comes
leaks nothing). Confirmations travel over a ZeroMQ PUSH -> PULL channel: ``HoldTable`` owns the
PULL end on the prefill worker, ``Confirmer`` the PUSH ends on decode workers. Each does its
ZeroMQ I/O on a thread of its own: a step never waits on a socket.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import zmq

logger = logging.getLogger(__name__)


class _Done(msgspec.Struct, array_like=True):
    request_id: str


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Done).decode
_MAX_UNPAIRED = 4096
"""Confirmations kept without a matching hold before the stale ones (older than the hold
timeout) are pruned."""


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
    """Prefill side: held requests, released on confirmation or at their deadline.

    A receiver thread reads the confirmations as they arrive, so a step never touches ZeroMQ:
    on this 2-vCPU VM the first poll/recv after the process slept costs 0.1-0.25 ms, paid
    inside the prefill's step when the step read the socket itself.
    """

    def __init__(self, host: str, hold_timeout_s: float) -> None:
        self.hold_timeout_s = hold_timeout_s
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        # close() wakes the receiver through its own inproc pair (a peer cannot send on it).
        stop_endpoint = f"inproc://tidekv-holds-{id(self):x}-{port}"
        stop_rx = ctx.socket(zmq.PAIR)
        stop_rx.bind(stop_endpoint)
        self._stop_tx = ctx.socket(zmq.PAIR)
        self._stop_tx.setsockopt(zmq.LINGER, 0)
        self._stop_tx.connect(stop_endpoint)
        self._deadlines: dict[str, float] = {}
        self._confirmed: dict[str, float] = {}  # request -> arrival, until released() pairs it with a hold
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._receive_loop, args=(sock, stop_rx), name="tidekv-holds",
                                        daemon=True)
        self._thread.start()

    def hold(self, request_id: str) -> None:
        with self._cond:
            self._deadlines[request_id] = time.monotonic() + self.hold_timeout_s
            if request_id in self._confirmed:
                self._cond.notify_all()  # confirmed before its hold was recorded

    def released(self) -> set[str]:
        """Requests whose blocks may be freed now (confirmed, or past their deadline)."""
        if not self._deadlines:  # every step of every engine asks: no lock while nothing is held
            return set()
        with self._cond:
            now = time.monotonic()
            out = {r for r in self._deadlines if r in self._confirmed}
            expired = {r for r, t in self._deadlines.items() if t <= now and r not in out}
            for r in expired:
                logger.warning("request %s: decode did not pull its KV within %.1f s; freeing the blocks",
                               r, self.hold_timeout_s)
            out |= expired
            for r in out:
                del self._deadlines[r]
                self._confirmed.pop(r, None)
            return out

    def wait(self, timeout_s: float) -> bool:
        """Sleeps until a held request is confirmed or ``timeout_s`` passes; True if one is."""
        with self._cond:
            return self._cond.wait_for(self._any_confirmed, max(0.0, timeout_s))

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

    def _any_confirmed(self) -> bool:
        return any(r in self._confirmed for r in self._deadlines)

    def _receive_loop(self, sock: zmq.Socket, stop: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while stop not in dict(poller.poll()):
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        request_id = _decode(frame).request_id
                    except msgspec.DecodeError:
                        logger.warning("dropped a malformed hand-off confirmation")
                        continue
                    self._record(request_id)
        except zmq.ContextTerminated:
            pass  # the process is shutting down
        except Exception:
            logger.exception("the hand-off confirmation receiver stopped; held blocks now free only at their deadline")
        finally:
            sock.close(linger=0)
            stop.close(linger=0)

    def _record(self, request_id: str) -> None:
        with self._cond:
            now = time.monotonic()
            self._confirmed[request_id] = now
            if len(self._confirmed) > _MAX_UNPAIRED:
                # Confirmations whose hold never came (a restarted prefill, a stray sender): a
                # real one is paired within a step or two, so anything this old is dropped.
                for r, t in list(self._confirmed.items()):
                    if now - t > self.hold_timeout_s and r not in self._deadlines:
                        del self._confirmed[r]
            if request_id in self._deadlines:
                self._cond.notify_all()


class Confirmer:
    """Decode side: tells a prefill worker that a request's blocks were pulled.

    ``confirm`` only queues the message: a sender thread puts it on the wire, so the step that
    pulled the blocks does not also pay for waking ZeroMQ's I/O thread (~0.1-0.25 ms on a 2-vCPU
    VM). The prefill frees the blocks a moment later; nothing waits for that.
    """

    def __init__(self) -> None:
        self._socks: dict[str, zmq.Socket] = {}
        self._queue: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_loop, name="tidekv-confirm", daemon=True)
        self._thread.start()

    def confirm(self, address: str, request_id: str) -> None:
        self._queue.put((address, request_id))

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            address, request_id = item
            sock = self._socks.get(address)
            if sock is None:
                sock = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.connect(f"tcp://{address}")
                self._socks[address] = sock
            try:
                sock.send(_encode(_Done(request_id)), zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("could not confirm request %s to %s (queue full); it frees at its deadline",
                               request_id, address)

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
