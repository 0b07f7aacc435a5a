"""MasterServer: puts a MasterService on the network. Framed TCP for RPC, HTTP for metrics.

One asyncio event loop does everything: each client connection's frames (see ``protocol``) are
handled as they arrive, one reply per request, in order; after a request the loop busy-polls its
sockets for ``busy_poll_us`` before sleeping (a client in a request loop sends the next one
within microseconds, and waking a sleeping vCPU costs tens of them), yielding its core to any
other runnable thread on every turn; the housekeeping timer runs
between requests, and a tiny HTTP server answers ``/metrics`` (Prometheus text) and
``/health`` (JSON). ``run_master`` serves in the foreground (the CLI); ``MasterServer.start()``
serves from a background thread (``tidekv up``, tests). Each connection is a ``MasterConnection``
(``connection``: framing, handshake, replies held until replicated).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from tidekv import eventloop
from tidekv.config import MasterConfig
from tidekv.errors import ConfigError
from tidekv.metrics import CONTENT_TYPE, Counter
from tidekv.store.ha.replication import Replicator
from tidekv.store.master.collector import FrozenHeap
from tidekv.store.master.connection import MasterConnection
from tidekv.store.master.fold import Fold
from tidekv.store.master.journal import JournalFile, Mirror
from tidekv.store.master.service import MasterService
from tidekv.values import format_host_port

if TYPE_CHECKING:
    from tidekv.store.ha.cluster import ClusterRole

logger = logging.getLogger(__name__)


class MasterServer:
    """Serves one MasterService. Addresses are known once ``start()`` (or ``serve()``) bound them."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.service = MasterService(config)
        self.auth_failures = self._count_auth_failures()
        self.rpc_port = 0
        self.metrics_port = 0
        self.heap: FrozenHeap | None = None  # the cycle collector kept off the index (a process tidekv owns)
        self._rpc: asyncio.Server | None = None
        self._spin_until = 0.0
        self._spinning = False
        # A memory guard only, far above the configured limit: a frame between the two gets a
        # clear "oversized" reply; a longer one closes its connection.
        self._max_frame = 2 * config.max_message_bytes + (1 << 20)
        self._connections: set[asyncio.Transport] = set()
        self._buffered = 0  # bytes of unfinished frames held over all connections
        self._partial: dict[MasterConnection, float] = {}  # connections holding an unfinished frame: since when
        self._refusals = 0  # connections refused for max_connections since the last log line
        self._refusal_logged = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._journal: JournalFile | None = None
        self._fold: Fold | None = None  # a snapshot being written by a child
        self._folds = {"done": 0, "failed": 0, "inline": 0}
        self._last_fold = (0.0, 0.0)  # the last fold's seconds in all, and its loop's pause
        if config.state_dir:
            self._journal = JournalFile(config.state_dir)
            self.service.enable_journal()
            self._journal_gauges(self._journal)
            self.service.not_serving = f"is rebuilding its index from its journal in {config.state_dir}"
        # Mount checks (mount_proof) wait on other processes' engines: never on the loop.
        self.mount_checks = concurrent.futures.ThreadPoolExecutor(max_workers=4,
                                                                  thread_name_prefix="tidekv-mount-check")
        self.recovered = threading.Event()  # set once the index is back (at once without a journal)
        self.recovery_s = 0.0
        self.replicator: Replicator | None = None  # while leading a cluster
        self._publishing = False  # a batch for the standbys is scheduled in this loop turn
        self._waiting: set[MasterConnection] = set()  # connections with replies waiting for replication
        self._parked: dict[str, set[MasterConnection]] = {}  # channel -> connections whose take or push waits on it
        self._waking = False
        self.role: ClusterRole | None = None
        if config.etcd:
            from tidekv.store.ha.cluster import ClusterRole

            self.role = ClusterRole(self)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def address(self) -> str:
        """Where clients connect: "host:port"."""
        return format_host_port(self.config.host, self.rpc_port)

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self, owns_process: bool = False) -> MasterServer:
        """Serves from a daemon thread; returns once listening. Raises ConfigError if it cannot bind.

        Args:
            owns_process: the program is tidekv's own (``tidekv up``): the cycle collector is kept
                off the index, as ``serve_forever`` does (``collector``). Leave it False inside
                another program, whose collector is its own to manage.
        """
        if owns_process:
            self.heap = FrozenHeap()
        self._thread = threading.Thread(target=lambda: eventloop.run(self._main()), name="tidekv-master", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self.role is not None:
            self.role.stop()
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def serve_forever(self) -> None:
        """Serves in the calling thread until interrupted, owning the process (its cycle
        collector is kept off the index: ``collector``). Raises ConfigError if it cannot bind."""
        self.heap = FrozenHeap()
        eventloop.run(self._main())
        if self._error is not None:
            raise self._error

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        http = None
        port, what = self.config.port, "its port"
        try:
            tls = self.config.server_tls()
            self._rpc = await self._loop.create_server(
                lambda: MasterConnection(self), self.config.host, self.config.port, ssl=tls,
                ssl_handshake_timeout=min(self.config.frame_timeout_s, 10.0) if tls is not None else None)
            self.rpc_port = self._rpc.sockets[0].getsockname()[1]
            if self.config.metrics_port >= 0:
                port, what = self.config.metrics_port, "its metrics port (--metrics-port; 0 = any free, -1 = off)"
                http = await asyncio.start_server(self._http, self.config.host, self.config.metrics_port)
                self.metrics_port = http.sockets[0].getsockname()[1]
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s or serve_forever()'s caller
            reason = f"master cannot listen on {format_host_port(self.config.host, port)}, {what}: {exc}"
            self._error = exc if isinstance(exc, ConfigError) else ConfigError(reason)
            self._ready.set()
            if self._rpc is not None:
                self._rpc.close()
            return
        tick = asyncio.ensure_future(self._ticker())
        if self._journal is not None:
            threading.Thread(target=self._recover, name="tidekv-master-recovery", daemon=True).start()
        else:
            self.recovered.set()
        if self.role is not None:
            self.role.start()
        logger.info(
            "tidekv master %s listening on %s%s (metrics http port %s)",
            self.service.master_id,
            self.address,
            " over TLS" + (" (client certificates required)" if self.config.tls_ca_file else "")
            if self.config.tls_cert_file else "",
            self.metrics_port if http else "off",
        )
        self._ready.set()
        try:
            await self._stopped.wait()
        finally:
            if self.role is not None:
                self.role.stop()
            tick.cancel()
            self._rpc.close()
            for transport in list(self._connections):
                transport.close()
            if http is not None:
                http.close()
            self.mount_checks.shutdown(wait=False, cancel_futures=True)
            if self._fold is not None:
                self._loop.remove_reader(self._fold.pidfd)
                self._fold.kill()  # the next start replays from the last whole snapshot
                self._fold = None
            if self._journal is not None:
                self._journal.close()
            logger.info("tidekv master stopped")

    # ---- journal ------------------------------------------------------------------------

    def _recover(self) -> None:
        """Replays the journal into the (not yet serving) service, then lets it serve. Runs in a
        thread while the loop answers every request with not_ready and skips housekeeping."""
        assert self._journal is not None and self._loop is not None
        started = time.perf_counter()
        mirror = Mirror(self.config.lease_ttl_s)
        gc.disable()  # millions of new objects would trigger collection after collection
        try:
            ops = self._journal.load(mirror, self.service.clock())
            self.service.restore(mirror)
            self._journal.resume()
        except Exception:  # noqa: BLE001 - a master that cannot read its journal must not serve
            logger.exception("master %s cannot recover from %s; not serving", self.service.master_id,
                             self.config.state_dir)
            self.service.not_serving = f"could not read its journal in {self.config.state_dir} (see its log)"
            return
        finally:
            gc.enable()
        self.recovery_s = time.perf_counter() - started
        stats = self.service.stats()
        logger.info("master %s recovered %d objects on %d segments from %d journal ops in %.3f s",
                    self.service.master_id, stats["keys"], len(stats["segments"]), ops, self.recovery_s)
        self._loop.call_soon_threadsafe(self._serve_recovered)

    def _serve_recovered(self) -> None:
        self.service.not_serving = ""
        self.recovered.set()

    def _persist(self) -> None:
        """Writes the ops of the changes just made to the journal file, before their requests are
        answered; when replicating, schedules one batch for everything this loop turn changed."""
        if self.replicator is not None:
            if not self._publishing:
                self._publishing = True
                assert self._loop is not None
                self._loop.call_soon(self._publish)
            return
        seq, ops = self.service.take_ops()
        if not ops or self._journal is None:
            return
        self._journal.append(ops)
        config = self.config
        if self._fold is None and self._journal.fold_due(config.fold_log_bytes, config.fold_log_ratio):
            self._start_fold()

    def _journal_gauges(self, journal: JournalFile) -> None:
        m = self.service.metrics
        m.gauge("tidekv_journal_log_bytes", "bytes of the journal's current log (folded past fold_log_bytes)",
                lambda: {(): journal.log_bytes})
        m.gauge("tidekv_journal_snapshot_bytes", "bytes of the journal's last snapshot",
                lambda: {(): journal.snapshot_bytes})
        m.gauge("tidekv_journal_folds_total",
                "folds of the journal into a new snapshot, by result: done or failed (a forked child), inline (on the "
                "loop: the fork was refused)",
                lambda: {(("result", r),): n for r, n in self._folds.items()}, kind="counter")
        m.gauge("tidekv_journal_last_fold_seconds", "the last fold, from the cut to its child's end",
                lambda: {(): self._last_fold[0]})
        m.gauge("tidekv_journal_last_fold_pause_seconds", "the last fold's pause of the master's loop (cut and fork)",
                lambda: {(): self._last_fold[1]})

    def _start_fold(self) -> None:
        """Folds the journal in a forked child; the loop pays the cut and the fork only."""
        assert self._journal is not None and self._loop is not None
        try:
            self._fold = Fold(self._journal, lambda: self.service.snapshot(columns=True))
        except OSError as exc:  # ENOMEM under vm.overcommit_memory=2, a process limit: fold here, waiting
            logger.error("master %s cannot fork to fold its journal (%s); folding on its loop instead, answering "
                         "nothing meanwhile (allow overcommit, vm.overcommit_memory=1, to keep it serving)",
                         self.service.master_id, exc)
            started = time.perf_counter()
            self._journal.rewrite(self.service.snapshot(columns=True))  # bounded replay over a pause
            self._folds["inline"] += 1
            self._last_fold = (time.perf_counter() - started,) * 2
            return
        if self._fold.pidfd >= 0:
            self._loop.add_reader(self._fold.pidfd, self._fold_ended)
        else:
            self._fold_ended()  # no pidfd (a kernel before 5.3): the loop waits, as folds used to

    def _fold_ended(self) -> None:
        fold, self._fold = self._fold, None
        assert fold is not None and self._loop is not None
        if fold.pidfd >= 0:
            self._loop.remove_reader(fold.pidfd)
        ok = fold.finish()
        self._folds["done" if ok else "failed"] += 1
        self._last_fold = (fold.seconds, fold.forked_s)
        if ok:
            logger.info("master %s folded its journal into snapshot %d in %.2f s (its loop paused %.1f ms)",
                        self.service.master_id, fold.generation, fold.seconds, 1e3 * fold.forked_s)
        else:
            logger.error("master %s: the child folding its journal exited with %s; nothing is lost (a restart "
                         "replays every log since the last snapshot) and the next fold starts over",
                         self.service.master_id, fold.exit_code)

    def _publish(self) -> None:
        """Sends the changes of this loop turn to the standbys as one batch (fewer wake-ups there)."""
        self._publishing = False
        if self.replicator is None:
            return
        seq, ops = self.service.take_ops()
        if ops:
            self.replicator.publish(seq, ops)

    def committed(self, seq: int) -> None:
        """Replication reached ``seq``: replies that waited for it go out."""
        if self.role is not None and not self.role.check_lease():
            return
        log = self.service.objects.journal
        if log is not None:
            log.committed(seq)
        for conn in list(self._waiting):
            if conn.flush(seq):
                self._waiting.discard(conn)

    def reset_service(self) -> None:
        """Drops the index and every connection (a deposed leader): nothing that waited for
        replication is answered."""
        if self.replicator is not None:
            self.replicator.close()
            self.replicator = None
        for transport in list(self._connections):
            transport.close()
        self._waiting.clear()
        self._parked.clear()
        self.service = MasterService(self.config)
        self.auth_failures = self._count_auth_failures()

    def _count_auth_failures(self) -> Counter:
        return self.service.metrics.counter("tidekv_master_auth_failures_total",
                                            "connections closed for failing authentication (tidekv.auth)")

    # ---- RPC ----------------------------------------------------------------------------

    def park(self, conn: MasterConnection, channel: str) -> None:
        """``conn`` holds a request that waits for ``channel`` to change."""
        self._parked.setdefault(channel, set()).add(conn)

    def unpark(self, conn: MasterConnection, channel: str) -> None:
        parked = self._parked.get(channel)
        if parked is not None:
            parked.discard(conn)
            if not parked:
                del self._parked[channel]

    def wake(self) -> None:
        """Hands the requests parked on channels that changed (items came or are ready again,
        room was freed) to the service again, until no handling changes another."""
        changed = self.service.channels.changed
        if self._waking:
            return  # the loop below sees what the nested handling changed
        self._waking = True
        try:
            while changed and self._parked:
                names = list(changed)
                changed.clear()
                for name in names:
                    for conn in list(self._parked.get(name, ())):
                        conn.retry(False)
            changed.clear()
        finally:
            self._waking = False

    def _handled(self) -> None:
        """Keeps the loop polling (not sleeping) for busy_poll_us after a request."""
        spin_s = self.config.busy_poll_us * 1e-6
        if spin_s <= 0:
            return
        self._spin_until = time.perf_counter() + spin_s
        if not self._spinning:
            self._spinning = True
            assert self._loop is not None
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        # While a callback is ready the loop polls its sockets without blocking. Each turn gives
        # the core to whatever else is runnable on it: on a host where the master shares its few
        # cores with clients and holders (2 vCPUs, say), a spin that keeps the core starves the
        # very processes whose next request it waits for (measured: 440 µs of master CPU per
        # put instead of 150, and the put's latency doubled).
        if time.perf_counter() < self._spin_until:
            assert self._loop is not None
            os.sched_yield()
            self._loop.call_soon(self._spin)
        else:
            self._spinning = False

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            if self.heap is not None and self.recovered.is_set():  # a standby's mirror too; not mid-replay
                self.heap.tick()
            if self.role is not None and not self.role.check_lease():
                continue
            if self.service.not_serving:
                continue
            try:
                self._drop_stalled()
                self.service.tick()
                self.wake()  # items ready again after their visibility ran out
                self._persist()
                if self.replicator is not None:
                    self.replicator.check()
            except Exception:  # noqa: BLE001 - housekeeping must not die with one bad state
                logger.exception("master housekeeping failed")

    def _drop_stalled(self) -> None:
        """Closes connections that sent nothing for frame_timeout_s in the middle of a request."""
        if not self._partial:
            return
        limit = time.monotonic() - self.config.frame_timeout_s
        for conn, since in list(self._partial.items()):
            if since < limit:
                conn._refuse(f"sent nothing for {self.config.frame_timeout_s} s in the middle of a request "
                             "(frame_timeout_s)")

    def admit(self) -> bool:
        """Whether one more client connection may stay open (max_connections); logs refusals every 10 s."""
        if len(self._connections) < self.config.max_connections:
            return True
        self._refusals += 1
        now = time.monotonic()
        if now - self._refusal_logged >= 10:
            logger.warning("refused %d connection(s): %d are open (max_connections)", self._refusals,
                           len(self._connections))
            self._refusals, self._refusal_logged = 0, now
        return False

    # ---- HTTP ---------------------------------------------------------------------------

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else "/"
            status, ctype, body = self._http_route(path)
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n")
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()

    def _http_route(self, path: str) -> tuple[str, str, bytes]:
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE, self.service.metrics.render().encode()
        if path == "/health":
            stats: dict[str, Any] = self.service.stats()
            role = self.role.state.value if self.role is not None else "lone"
            body = {"status": "ok", "master": self.address, "role": role, "serving": not self.service.not_serving,
                    **stats}
            if self.replicator is not None:
                body["insync"] = self.replicator.insync
            if self.heap is not None:  # the cycle collector kept off the index (``collector``)
                body["gc"] = {"frozen_objects": gc.get_freeze_count(), "freezes": self.heap.freezes,
                              "thaws": self.heap.thaws}
            return "200 OK", "application/json", json.dumps(body).encode()
        return "404 Not Found", "text/plain", b"not found: try /metrics or /health\n"


def run_master(config: MasterConfig) -> None:
    """Serves a master in the foreground until SIGINT/SIGTERM."""
    MasterServer(config).serve_forever()
