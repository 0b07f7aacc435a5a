"""No single request delays the master's heartbeat handling by more than 100 ms (issue 17's bar):
while another connection sends the largest request of each kind the limits admit
(``max_batch_keys`` keys of ``max_key_bytes``-long keys, under ``max_message_bytes``), a client
in a heartbeat loop measures every heartbeat's round trip; none may take 100 ms longer than the
quiet baseline."""

from __future__ import annotations

import threading
import time

import pytest
from tidekv.config import DEFAULT_MAX_BATCH_KEYS, MasterConfig
from tidekv.store.client.master_client import MasterClient
from tidekv.store.wire import protocol as p

from tests.store import wire
from tests.store.conftest import SpawnMaster

pytestmark = pytest.mark.timeout(300)

BAR_S = 0.100


def _largest(kind: str, client: str, keys: list[bytes], tokens: list[int]) -> p.Body:
    n = len(keys)
    return {
        "put_start": p.PutStart(client, keys, [4096] * n),
        "put_end": p.PutEnd(client, keys, tokens),
        "upsert": p.PutStart(client, keys, [4096] * n, upsert=True),
        "get": p.Get(keys),
        "exists": p.Exists(keys),
        "locate": p.Locate(keys),
        "remove": p.Remove(keys, force=True),
    }[kind]  # type: ignore[return-value]


def _measure(master_address: str, keys: list[bytes], attempt: int) -> tuple[float, float, dict[str, float]]:
    """(worst heartbeat round trip, quiet p50, per-kind request times) for one pass of every kind."""
    attacker = wire.connect(master_address, timeout_s=60)
    request_id = 0

    def ask(body: p.Body) -> p.Reply:
        nonlocal request_id
        request_id += 1
        attacker.sendall(p.frame(p.encode(p.Envelope(p.PROTOCOL_VERSION, request_id, body))))
        return p.decode_reply(wire.recv_frame(attacker))

    name = f"attacker{attempt}"
    assert not ask(p.Hello(name, p.PROTOCOL_VERSION)).error_kind
    assert not ask(p.MountSegment(name, f"big{attempt}", f"127.0.0.1:{attempt + 1}", 1 << 20, 1 << 40)).error_kind
    client = MasterClient(master_address, f"heartbeater{attempt}", timeout_s=10.0, register=True)
    client.connect()
    rtts: list[float] = []
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            client.call(p.Heartbeat(f"heartbeater{attempt}"))
            rtts.append(time.perf_counter() - started)
            time.sleep(0.002)

    for _ in range(200):  # the quiet baseline
        started = time.perf_counter()
        client.call(p.Heartbeat(f"heartbeater{attempt}"))
        rtts.append(time.perf_counter() - started)
    baseline_s = sorted(rtts)[len(rtts) // 2]
    rtts.clear()
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    handled: dict[str, float] = {}
    try:
        tokens: list[int] = []
        for kind in ("put_start", "put_end", "get", "exists", "locate", "upsert", "remove"):
            started = time.perf_counter()
            reply = ask(_largest(kind, name, keys, tokens))
            handled[kind] = time.perf_counter() - started
            assert not reply.error_kind, (kind, reply.error)
            if kind == "put_start":
                tokens = [slot[1] for slot in reply.result]  # type: ignore[union-attr]
    finally:
        stop.set()
        thread.join(timeout=30)
        attacker.close()
        client.close()
    # A few beats at least (each ~2 ms apart): the requests may all be handled within ~50 ms,
    # which is the point, so more cannot be asked for.
    assert len(rtts) >= 5, "heartbeats went on throughout"
    return max(rtts), baseline_s, handled


def test_the_largest_admitted_requests_do_not_delay_heartbeats(spawn_master: SpawnMaster) -> None:
    master = spawn_master(client_ttl_s=30.0)
    defaults = MasterConfig()
    n = defaults.max_batch_keys
    assert n == DEFAULT_MAX_BATCH_KEYS
    key_bytes = min(defaults.max_key_bytes, (defaults.max_message_bytes // n) - 64)
    keys = [b"%0*d" % (key_bytes, i) for i in range(n)]
    # Up to three passes: another process hogging the 2 vCPUs can stall one heartbeat past the
    # bar by itself, but a request that holds the master's loop (725 ms at 65536 keys) fails all.
    results = []
    for attempt in range(3):
        worst_s, baseline_s, handled = _measure(master.address, keys, attempt)
        results.append(f"pass {attempt}: worst heartbeat {worst_s * 1e3:.1f} ms (quiet p50 {baseline_s * 1e3:.2f} ms); "
                       + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in handled.items()))
        print(results[-1])
        if worst_s - baseline_s <= BAR_S:
            return
    pytest.fail(f"with {n}-key requests, every pass delayed a heartbeat by more than {BAR_S * 1e3:.0f} ms:\n"
                + "\n".join(results))
