"""Request/reply round trip between two Python processes on this host: ZeroMQ vs a plain socket.

Why the store's master RPC is framed msgpack over plain TCP rather than ZeroMQ: ZeroMQ moves
every message through an I/O thread on each side (four thread hand-offs per round trip). Both
servers echo 64-byte messages and poll for the next request (``--server-poll-us``) before sleeping,
as the master does; the client blocks on its socket (``--client-poll-us 0``) or polls first, as
store clients do (``rpc_busy_poll_us``). Reported: p50 and p90 of ``--n`` round trips, and the ratio.

Usage: .venv/bin/python benchmarks/rpc_roundtrip.py [--n 5000] [--client-poll-us 0] [--server-poll-us 200]
Needs pyzmq (``pip install pyzmq``), which tidekv itself no longer depends on: every control
channel is ``tidekv.channel``, built on the result of this comparison.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
import time

try:
    import zmq
except ImportError:
    sys.exit("benchmarks/rpc_roundtrip.py compares against ZeroMQ: pip install pyzmq (tidekv does not need it)")

MESSAGE = b"x" * 64


def _zmq_server(port_q: mp.Queue, poll_s: float) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        until = time.perf_counter() + poll_s
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
                break
            except zmq.Again:
                if time.perf_counter() > until:
                    sock.poll()
                    until = time.perf_counter() + poll_s
        sock.send_multipart(frames)


def _tcp_server(port_q: mp.Queue, poll_s: float) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_q.put(listener.getsockname()[1])
    while True:  # one client connection at a time (the warm-up, then the measurement)
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setblocking(False)
        until = 0.0
        while True:
            try:
                data = conn.recv(len(MESSAGE))
            except BlockingIOError:
                if time.perf_counter() <= until:
                    continue
                conn.setblocking(True)
                data = conn.recv(len(MESSAGE))
                conn.setblocking(False)
            if not data:
                break
            conn.sendall(data)
            until = time.perf_counter() + poll_s
        conn.close()


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.9)] * 1e6


def _zmq_client(port: int, n: int, poll_s: float) -> tuple[float, float]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        sock.send(MESSAGE)
        until = started + poll_s
        while True:
            try:
                sock.recv(zmq.NOBLOCK)
                break
            except zmq.Again:
                if time.perf_counter() > until:
                    sock.recv()
                    break
        samples.append(time.perf_counter() - started)
    sock.close(linger=0)
    return _percentiles(samples)


def _tcp_client(port: int, n: int, poll_s: float) -> tuple[float, float]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        sock.sendall(MESSAGE)
        until = started + poll_s
        got = 0
        while got < len(MESSAGE):
            try:
                got += len(sock.recv(len(MESSAGE) - got))
            except BlockingIOError:
                if time.perf_counter() > until:
                    sock.setblocking(True)
                    got += len(sock.recv(len(MESSAGE) - got))
                    sock.setblocking(False)
        samples.append(time.perf_counter() - started)
    sock.close()
    return _percentiles(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="round trips per transport (default 5000)")
    ap.add_argument("--client-poll-us", type=int, default=0, help="client polls this long before blocking (default 0)")
    ap.add_argument("--server-poll-us", type=int, default=200, help="servers poll this long before sleeping (default 200)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = {}
    for name, server, client in (("zeromq", _zmq_server, _zmq_client), ("tcp", _tcp_server, _tcp_client)):
        port_q: mp.Queue = ctx.Queue()
        proc = ctx.Process(target=server, args=(port_q, args.server_poll_us * 1e-6), daemon=True)
        proc.start()
        try:
            port = port_q.get(timeout=30)
            client(port, 200, args.client_poll_us * 1e-6)  # warm-up
            rows[name] = client(port, args.n, args.client_poll_us * 1e-6)
        finally:
            proc.kill()
            proc.join()
    print(f"{'transport':10s} {'p50 us':>8s} {'p90 us':>8s}   (client polls {args.client_poll_us} us, servers {args.server_poll_us} us)")
    for name, (p50, p90) in rows.items():
        print(f"{name:10s} {p50:8.1f} {p90:8.1f}")
    print(f"zeromq / tcp p50: {rows['zeromq'][0] / rows['tcp'][0]:.1f}x")


if __name__ == "__main__":
    main()
