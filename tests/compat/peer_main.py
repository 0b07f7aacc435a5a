"""A Mooncake-compat engine in its own process, the remote side of the compat contract tests.

Run as ``python -m tests.compat.peer_main '{"protocol": "tcp", "size": N, "seed": S}'`` from the
repository root. It initializes ``tidekv.compat.mooncake.TransferEngine``, registers a buffer of
``size`` bytes holding ``payload(seed, size)``, and prints {"session", "addr", "size", "pid"}.
Each later stdin line is one JSON command with one JSON answer: ``digest`` (of a byte range of
the buffer), ``write`` (peer-initiated batch write into another engine). EOF on stdin exits.
Neighbours: ``tests.store.procs.ChildProcess`` drives it; ``test_mooncake_compat`` is the other end.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import traceback
from typing import Any

from tests.store.payload import digest, payload
from tidekv.compat.mooncake import TransferEngine
from tidekv.logs import configure_logging


def main() -> int:
    spec = json.loads(sys.argv[1])
    configure_logging("INFO")
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", spec.get("protocol", "tcp"), "") != 0:
        raise SystemExit("initialize failed")
    size = spec["size"]
    buf = ctypes.create_string_buffer(payload(spec["seed"], size), size)
    addr = ctypes.addressof(buf)
    if engine.register_memory(addr, size) != 0:
        raise SystemExit("register_memory failed")
    hello = {"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": addr, "size": size, "pid": os.getpid()}
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply: dict[str, Any] = {"ok": True}
            if cmd["cmd"] == "digest":
                reply["digest"] = digest(ctypes.string_at(addr + cmd["offset"], cmd["length"]))
            elif cmd["cmd"] == "write":
                reply["ret"] = engine.batch_transfer_sync_write(
                    cmd["session"], [addr + o for o in cmd["offsets"]], cmd["remote_addrs"], cmd["lengths"])
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the test, which judges it
            traceback.print_exc()
            reply = {"ok": False, "error_type": type(exc).__name__, "error": str(exc)}
        print(json.dumps(reply), flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
