"""A store client in its own process (a segment holder, writer or reader), driven over stdin/stdout.

Run as ``python -m tests.store.agent_main '{"master": "host:port", "segment_size": N,
"store": {StoreConfig fields}}'`` from the repository root. The first stdout line reports
{"engine", "segment", "client_id", "pid"}; each later stdin line is one JSON command and gets one
JSON answer ({"ok": true, ...} or {"ok": false, "error_type", "error"}). Object bytes are
``payload(seed, size)`` on both sides, so only digests cross the pipe. Logs go to stderr. EOF on
stdin closes the store and exits. Neighbours: ``procs.AgentProcess`` is the other end.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import msgspec
from tidekv.bench import churn
from tidekv.config import StoreConfig
from tidekv.errors import TidekvError
from tidekv.logs import configure_logging
from tidekv.store import Pin, Store
from tidekv.store.client.rpc import MasterChannel
from tidekv.store.wire import protocol as p
from tidekv.transfer import TransferOp, TransferRequest

from tests.store.payload import digest, is_whole_version, payload


class Agent:
    def __init__(self, master: str, segment_size: int, store: dict[str, Any], host: str | None = None) -> None:
        self.master = master
        self.store = Store.connect(master, segment_size=segment_size, config=StoreConfig(**store), host=host)
        self.books = churn.Books()
        self._read_buf: Any = None  # read_into's registered buffer, kept between calls

    def hello(self) -> dict[str, Any]:
        return {"engine": self.store.engine.name, "segment": self.store.segment_name,
                "client_id": self.store.client_id, "pid": os.getpid()}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "put":
            self.store.put(cmd["key"], payload(cmd["seed"], cmd["size"]), pin=Pin(cmd.get("pin", 0)),
                           replicas=cmd.get("replicas"))
            return {}
        if op == "get":
            data = self.store.get(cmd["key"])
            return {"size": len(data), "digest": digest(data)}
        if op == "get_many":  # rounds of one batch get: each round's seconds, and the last round's answer
            return self.get_many(cmd["keys"], cmd.get("rounds", 1))
        if op == "stats":
            return {"stats": self.store.stats()}
        if op == "locate":
            return {"engines": self.store.locate_many(cmd["keys"])}
        if op == "read_loop":
            return self.read_loop(cmd["key"], cmd["duration_s"], cmd["base_size"])
        if op == "churn":  # the mixed load of tidekv.bench.churn on this agent's keys, books kept across calls
            # began_s, ended_s, first_ok_s: this call's bounds and its first acknowledged op
            # (time.monotonic: one clock for every process of the machine), so a test can tell
            # that what it broke meanwhile landed while the load ran
            began, earlier = time.monotonic(), len(self.books.successes)
            churn.churn(self.store, cmd["prefix"], cmd["duration_s"], keys=cmd.get("keys", 100),
                        size=cmd.get("size", 4096), seed=cmd.get("seed", 0), books=self.books)
            ok = self.books.successes[earlier:]
            return {**self.books.summary(), "began_s": began, "ended_s": time.monotonic(),
                    "first_ok_s": ok[0] if ok else None}
        if op == "verify":
            return {**churn.verify(self.store, self.books, cmd.get("size", 4096)), **self.books.summary()}
        if op == "put_start_raw":
            return self.put_start_raw(cmd["key"], cmd["size"], cmd["seed"])
        if op == "chan_put":  # tensors of payload(seed, size) bytes into channel "name"; their seqs
            import torch

            tensors = [torch.frombuffer(bytearray(payload(seed, cmd["size"])), dtype=torch.uint8)
                       for seed in cmd["seeds"]]
            return {"seqs": self.store.tensor_channel(cmd["name"], **cmd.get("options", {})).put_many(tensors)}
        if op == "chan_produce":  # n tensors of `size` bytes in put_many calls of `batch`; seconds taken
            import torch

            channel = self.store.tensor_channel(cmd["name"], **cmd.get("options", {}))
            tensors = [torch.full((cmd["size"],), i % 251, dtype=torch.uint8) for i in range(cmd["batch"])]
            started = time.monotonic()
            for _ in range(cmd["n"] // cmd["batch"]):
                channel.put_many(tensors)
            return {"seconds": time.monotonic() - started}
        if op == "chan_consume":  # take and ack until n items came, up to `batch` a take; seconds taken
            channel = self.store.tensor_channel(cmd["name"], **cmd.get("options", {}))
            got = timed = 0
            started = time.monotonic() if cmd.get("time_all") else None
            items = []
            while got < cmd["n"]:
                items = channel.take(cmd["batch"], timeout_s=60, ack=items)  # acks the last batch on the way
                got += len(items)
                if started is None and not cmd.get("time_all"):  # from the first batch in hand: not the wait
                    started = time.monotonic()
                else:
                    timed += len(items)
            channel.ack(items)
            return {"seconds": time.monotonic() - started, "items": got, "timed_items": timed}
        if op == "read_into":  # rounds of get_many_into of `keys` into one registered buffer; each round's seconds
            size = cmd["size"]
            buf = self.read_buffer(size * len(cmd["keys"]))
            spans = [(buf.address + i * size, size) for i in range(len(cmd["keys"]))]
            elapsed = []
            for _ in range(cmd["rounds"]):
                started = time.monotonic()
                self.store.get_many_into(cmd["keys"], spans)
                elapsed.append(time.monotonic() - started)
            return {"elapsed_s": elapsed}
        if op == "chan_take":  # take (and ack unless told not to); each item's seq and digest
            channel = self.store.tensor_channel(cmd["name"], visibility_s=cmd.get("visibility_s", 60.0))
            got = channel.take(cmd.get("max_items", 1), cmd.get("wait_s"))
            if cmd.get("ack", True):
                channel.ack(got)
            return {"items": [[d.seq, digest(d.tensor.numpy().tobytes())] for d in got]}
        raise ValueError(f"unknown command {op!r}")

    def read_buffer(self, size: int) -> Any:
        """A registered buffer of ``size`` bytes, kept for the next read_into of that size (so a
        bench's CPU accounting counts reads, not page faults of fresh memory)."""
        if self._read_buf is None or self._read_buf.length != size:
            if self._read_buf is not None:
                self.store.engine.unregister(self._read_buf)
                self._read_buf = None
            self._read_buf = self.store.engine.allocate(size)
        return self._read_buf

    def get_many(self, keys: list[str], rounds: int) -> dict[str, Any]:
        """``rounds`` of ``get_many(keys)``: each round's seconds, and per key of the last round its
        digest (None: absent) or, for a batch that failed, the failed keys' error types."""
        elapsed, digests, failed = [], [], {}
        for _ in range(rounds):
            started = time.monotonic()
            try:
                values = self.store.get_many(keys)
                digests, failed = [digest(v) if v is not None else None for v in values], {}
            except TidekvError as exc:
                digests, failed = [], {k.decode(): type(e).__name__ for k, e in exc.failures}
            elapsed.append(time.monotonic() - started)
        return {"elapsed_s": elapsed, "digests": digests, "failed": failed}

    def read_loop(self, key: str, duration_s: float, base_size: int) -> dict[str, Any]:
        """Reads ``key`` for ``duration_s``; counts reads, torn values (see payload.versioned) and errors."""
        reads, torn, versions, errors = 0, 0, set(), {}
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            try:
                data = self.store.get(key)
            except Exception as exc:  # noqa: BLE001 - counted by type, the test judges them
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            reads += 1
            if is_whole_version(data, base_size):
                versions.add(data[0])
            else:
                torn += 1
        return {"reads": reads, "torn": torn, "distinct_versions": len(versions), "errors": errors}

    def put_start_raw(self, key: str, size: int, seed: int) -> dict[str, Any]:
        """Starts a put as this (heartbeating) client and writes the first half of the bytes, never ending it.

        The caller then kills this process: a writer dead in the middle of a put.
        """
        channel = MasterChannel(self.master, self.store.client_id, 5.0)
        try:
            channel.call(p.Hello(self.store.client_id, p.PROTOCOL_VERSION))  # a connection acts for who said hello
            slots = channel.call(p.PutStart(self.store.client_id, [key.encode()], [size], 1, "", int(Pin.NONE), False))
        finally:
            channel.close()
        slot = msgspec.convert(slots, list[p.PutSlot])[0]
        if slot.status != p.Status.OK:
            raise RuntimeError(f"put_start of {key!r} answered status {p.Status(slot.status).name}")
        half = max(1, size // 2)
        source = bytearray(payload(seed, size)[:half])
        region = self.store.register(source)
        try:
            loc = slot.locations[0]
            write = TransferRequest(TransferOp.WRITE, region.address, half, loc.engine, loc.addr)
            self.store.engine.transfer([write]).wait(10)
        finally:
            self.store.unregister(region)
        return {"token": slot.token, "written": half}

    def close(self) -> None:
        self.store.close()


def main() -> int:
    spec = json.loads(sys.argv[1])
    configure_logging("DEBUG" if os.environ.get("TIDEKV_TEST_DEBUG") else "INFO")
    agent = Agent(spec["master"], spec["segment_size"], spec["store"], spec.get("host"))
    print(json.dumps(agent.hello()), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = {"ok": True, **agent.handle(cmd)}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
            traceback.print_exc()
            reply = {"ok": False, "error_type": type(exc).__name__, "error": str(exc)}
        print(json.dumps(reply), flush=True)
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
