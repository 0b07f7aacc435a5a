"""A store master in its own process, for tests that kill or restart it.

Run as ``python -m tests.store.master_main '{"config": {MasterConfig fields}}'`` from the
repository root; ``TIDEKV_MASTER_*`` variables set the fields the spec leaves out, as for
``tidekv master`` (a bench run with the busy poll off, say). The first stdout line is
{"address", "port", "metrics_port", "master_id", "pid"}; logs go to stderr. EOF on stdin (the
test is done, or died) stops the master cleanly. A fixed port that is still held by a master just
killed is retried for a few seconds. Neighbours: ``procs.MasterProcess`` is the other end of the pipe.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tidekv.config import MasterConfig
from tidekv.errors import ConfigError
from tidekv.logs import configure_logging
from tidekv.store import MasterServer

BIND_RETRY_S = 10.0


def start(config: MasterConfig) -> MasterServer:
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return MasterServer(config).start()
        except ConfigError:
            if config.port == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    spec = json.loads(sys.argv[1])
    configure_logging("DEBUG" if os.environ.get("TIDEKV_TEST_DEBUG") else "INFO")
    server = start(MasterConfig.from_env(**spec["config"]))
    hello = {"address": server.address, "port": server.rpc_port, "metrics_port": server.metrics_port,
             "master_id": server.service.master_id, "pid": os.getpid()}
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        print(json.dumps({"ok": False, "error_type": "ValueError", "error": f"unknown command {cmd!r}"}), flush=True)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
