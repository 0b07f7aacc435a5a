"""What placing a put costs the master as the pool's holders grow in number.

A fleet's pool is hundreds of holders, each mounting a segment. The master (in-process, no
network: ``MasterService.handle`` on encoded requests, as ``tidekv bench master`` does) serves
PutStart+PutEnd of new keys in batches of 64, 4096-byte objects, one replica, no preferred
segment, with S segments mounted; for each S it reports the master's µs per key and the µs of
``SegmentTable.allocate`` alone. Nothing else running; the cost should not grow with S.

Usage: .venv/bin/python -m benchmarks.placement [--segments 4,64,512,2048] [--keys 64000] [--json FILE]
"""

from __future__ import annotations

import argparse
import time

from tidekv.bench.master_scale import _call, _key
from tidekv.config import MasterConfig
from tidekv.report import Column, format_table, write_json_lines
from tidekv.store.master.service import MasterService
from tidekv.store.wire import protocol as p

_BATCH = 64
_OBJECT = 4096


def _service(segments: int) -> MasterService:
    svc = MasterService(MasterConfig(port=0, metrics_port=-1, high_watermark=1.0))
    for i in range(segments):
        client = f"holder-{i}"
        _call(svc, 0, p.Hello(client, p.PROTOCOL_VERSION))
        _call(svc, 0, p.MountSegment(client, f"seg{i}", f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:1", 1 << 20,
                                     1 << 34))
    _call(svc, 0, p.Hello("writer", p.PROTOCOL_VERSION))
    return svc


def measure(segments: int, keys: int) -> dict[str, float]:
    """µs per key of PutStart+PutEnd and of placement alone, with ``segments`` mounted."""
    svc = _service(segments)
    batches = [[_key(b * _BATCH + i) for i in range(_BATCH)] for b in range(keys // _BATCH)]
    started = time.perf_counter()
    for batch in batches:
        slots = _call(svc, 1, p.PutStart("writer", batch, [_OBJECT] * _BATCH))
        _call(svc, 2, p.PutEnd("writer", batch, [s[1] for s in slots]))
    put_us = (time.perf_counter() - started) / keys * 1e6
    table = _service(segments).segments
    started = time.perf_counter()
    for _ in range(keys):
        table.allocate(_OBJECT, 1, "")
    return {"segments": segments, "put_us_per_key": put_us,
            "allocate_us": (time.perf_counter() - started) / keys * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segments", default="4,64,512,2048", help="segment counts, comma-separated")
    parser.add_argument("--keys", type=int, default=64_000, help="new keys put per segment count")
    parser.add_argument("--json", help="write one row per segment count to this file")
    args = parser.parse_args()
    rows = [measure(int(s), args.keys) for s in args.segments.split(",")]
    print(format_table(rows, [Column("segments", "segments", ",d"),
                              Column("put_us_per_key", "PutStart+PutEnd us/key", ".2f"),
                              Column("allocate_us", "allocate us", ".2f")]))
    if args.json:
        write_json_lines(args.json, rows)

if __name__ == "__main__":
    main()
