"""Soak test of the store (issue 17, item 5): ``clients`` processes at full rate (put, get,
upsert, remove, and transfer-engine transfers) against one master and two holders, one holder
SIGKILLed and restarted every ``--kill-every-s``; reports errors by kind, memory (RSS and fds of
every process, the master's segments) at start and end, the RSS growth of every process from
minute 2 (a fifth of shorter runs) to the end, and every acknowledged object read back (lost
ones sorted into: every holder of their replicas killed / after a failed write / unexplained).
See ``tidekv.bench.soak``.

    python benchmarks/soak.py --minutes 10 [--clients 8] [--kill-every-s 60] [--json FILE]

Exit status 1 when an acknowledged object was lost unexplained, read stale or corrupt, or a
transfer came back different.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tidekv.bench import soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kill-every-s", type=float, default=60.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--keys", type=int, default=200, help="keys per client (200)")
    parser.add_argument("--cold-keys", type=int, default=50, help="keys per client written once, read at the end (50)")
    parser.add_argument("--value-bytes", type=int, default=4096)
    parser.add_argument("--json", default="", help="write the report here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = soak.run(args.minutes * 60, clients=args.clients, kill_every_s=args.kill_every_s,
                      replicas=args.replicas, keys=args.keys, cold_keys=args.cold_keys, size=args.value_bytes)
    print(soak.format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = (report["lost"]["unexplained"] or report["stale_reads"] or report["found"].get("corrupt")
           or report["transfers"].get("mismatch"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
