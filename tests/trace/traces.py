"""Small hand-made FAST'25 traces for the trace tools' tests, written to files as the CLI reads them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tidekv.trace import TraceRequest


def request(hash_ids: Sequence[int], input_length: int, timestamp_ms: float = 0.0, output_length: int = 4) -> TraceRequest:
    return TraceRequest(timestamp_ms, input_length, output_length, tuple(hash_ids))


# Worked by hand in test_cache.py: 4 requests, 3524 prompt tokens.
HAND = [
    request([1, 2], 1024, 0),
    request([1, 2, 3], 1500, 1000),
    request([1, 4], 700, 61_000),
    request([1], 300, 62_000),
]


def write_trace(path: Path, requests: Sequence[TraceRequest]) -> Path:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
    return path
