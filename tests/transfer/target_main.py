"""A target engine in its own process, driven by the tests over stdin/stdout (one JSON per line).

Run as ``python -m tests.transfer.target_main '<json spec>'`` from the repository root. The spec
gives the engine config and the regions to create, each filled with ``reference.pattern(seed)``.
Optional "port" and "host" in the spec are the engine's (default 0: any free one, and 127.0.0.1). The first stdout line reports the engine name, pid and region addresses; every later line
answers one command. Logs go to stderr. EOF on stdin (the test process died) stops the target.
Neighbours: ``harness.TargetProcess`` is the other end of the pipe.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
import traceback
from typing import Any

import numpy as np

from tests.transfer.reference import pattern
from tidekv import TransferConfig, TransferEngine, TransportKind
from tidekv.transfer import Region


class Target:
    def __init__(self, config: dict[str, Any], port: int = 0, host: str = "127.0.0.1") -> None:
        if "transport" in config:
            config = dict(config, transport=TransportKind(config["transport"]))
        self.engine = TransferEngine(host=host, port=port, config=TransferConfig(**config))
        self.regions: dict[str, Region] = {}
        self.keep: dict[str, Any] = {}
        self.retired: dict[str, Region] = {}  # unregistered plain memory, still readable here

    def add(self, name: str, kind: str, size_bytes: int, seed: int) -> dict[str, Any]:
        if kind == "alloc":
            region = self.engine.allocate(size_bytes)
        elif kind == "bytearray":
            self.keep[name] = bytearray(size_bytes)
            region = self.engine.register(self.keep[name])
        elif kind == "numpy":
            self.keep[name] = np.zeros(size_bytes, dtype=np.uint8)
            region = self.engine.register(self.keep[name])
        else:
            raise ValueError(f"unknown region kind {kind!r}")
        self.regions[name] = region
        region.view()[:] = pattern(seed, size_bytes)
        return self.describe(name)

    def memory(self, name: str) -> memoryview:
        region = self.regions.get(name) or self.retired[name]
        return region.view()

    def describe(self, name: str) -> dict[str, Any]:
        r = self.regions[name]
        return {"address": r.address, "length": r.length, "is_shared": r.is_shared}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "ping":
            return {}
        if op == "add":
            return self.add(cmd["region"], cmd["kind"], cmd["size_bytes"], cmd["seed"])
        if op == "fill":
            view = self.memory(cmd["region"])
            view[:] = pattern(cmd["seed"], len(view))
            return {}
        if op == "dump":
            with open(cmd["path"], "wb") as f:
                f.write(self.memory(cmd["region"]))
            return {}
        if op == "read":
            view = self.memory(cmd["region"])
            data = bytes(view[cmd["offset"] : cmd["offset"] + cmd["length"]])
            return {"data": base64.b64encode(data).decode()}
        if op == "unregister":
            region = self.regions.pop(cmd["region"])
            self.engine.unregister(region)
            if not region.is_shared:  # allocate()d memory is gone; plain memory stays ours
                self.retired[cmd["region"]] = region
            return {}
        if op == "stats":
            return {"stats": self.engine.stats()}
        if op == "stop":
            self.engine.close()
            return {}
        raise ValueError(f"unknown command {op!r}")


def main() -> int:
    logging.basicConfig(
        stream=sys.stderr, level=logging.DEBUG, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    spec = json.loads(sys.argv[1])
    out = sys.stdout
    target = Target(spec.get("config", {}), spec.get("port", 0), spec.get("host", "127.0.0.1"))
    regions = {name: target.add(name, *args) for name, args in spec.get("regions", {}).items()}
    out.write(json.dumps({"name": target.engine.name, "pid": os.getpid(), "regions": regions}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = {"ok": True, **target.handle(cmd)}
        except Exception as e:  # reported to the test, which decides whether it is expected
            logging.getLogger("target").warning("command %s failed:\n%s", cmd, traceback.format_exc())
            reply = {"ok": False, "error_type": type(e).__name__, "error": str(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if cmd["cmd"] == "stop":
            return 0
    target.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
