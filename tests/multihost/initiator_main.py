"""A transfer initiator run on a rig host against a target on another (``tests.transfer.target_main``).

``python -m tests.multihost.initiator_main '<spec>'``; the spec names the target ("target"), its
regions as its hello reported them ("regions"), their seeds ("seeds") and a "mode":

- ``contract``: batches of random sizes and offsets, READ from "mem" and WRITE to "out", then a
  scatter batch of 1,000 small READs; every byte checked against ``tests.transfer.reference``.
  Prints one JSON line: the transport ``connect`` chose, the bytes moved, and the first mismatch.
- ``until_error``: READs "mem" in 8 MiB batches, printing "looping" once one succeeded, until a
  batch fails; then prints the error's type and how long the failing batch took.

Checks run here because the pytest process is on none of the rig's hosts. Neighbours:
``test_transfer_hosts`` (drives it), ``tests/transfer/test_contract.py`` (the same contract on one host).
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

from tests.transfer.reference import READ, WRITE, Copy, apply, first_difference, pattern, place_disjoint, random_lengths
from tidekv import TidekvError, TransferEngine, TransferOp, TransferRequest
from tidekv.logs import configure_logging

WAIT_S = 30.0


def _requests(copies: list[Copy], local: int, target: str, regions: dict[str, Any]) -> list[TransferRequest]:
    return [TransferRequest(TransferOp.READ if c.op == READ else TransferOp.WRITE, local + c.local_offset, c.length,
                            target, regions[c.remote]["address"] + c.remote_offset) for c in copies]


def contract(engine: TransferEngine, spec: dict[str, Any]) -> dict[str, Any]:
    target, regions, seeds = spec["target"], spec["regions"], spec["seeds"]
    size = regions["mem"]["length"]
    rng = random.Random(spec.get("seed", 0))
    transport = engine.connect(target)
    buf = engine.register(bytearray(pattern(7, size)))
    local = {"buf": bytearray(pattern(7, size))}
    remote = {"mem": bytearray(pattern(seeds["mem"], size)), "out": bytearray(pattern(seeds["out"], size))}
    moved = 0
    for round_ in range(6):
        op = READ if round_ % 2 == 0 else WRITE
        lengths = random_lengths(rng, rng.randint(1, 40), 1 << 20)
        while sum(lengths) > size:
            lengths.pop()
        local_offsets = place_disjoint(rng, lengths, size)
        remote_offsets = place_disjoint(rng, lengths, size) if op == WRITE else \
            [rng.randrange(size - n + 1) for n in lengths]
        copies = [Copy(op, "buf", lo, n, "mem" if op == READ else "out", ro)
                  for lo, n, ro in zip(local_offsets, lengths, remote_offsets, strict=True)]
        engine.transfer(_requests(copies, buf.address, target, regions)).wait(timeout_s=WAIT_S)
        apply(copies, local, remote)
        moved += sum(lengths)
    # Scatter: 1,000 small READs at random places.
    copies = [Copy(READ, "buf", i * 512, 512, "mem", rng.randrange(size - 512)) for i in range(1000)]
    engine.transfer(_requests(copies, buf.address, target, regions)).wait(timeout_s=WAIT_S)
    apply(copies, local, remote)
    moved += 1000 * 512
    # What the target holds in "out" now, read back whole.
    check = engine.register(bytearray(size))
    engine.transfer([TransferRequest(TransferOp.READ, check.address, size, target,
                                     regions["out"]["address"])]).wait(timeout_s=WAIT_S)
    mismatch = first_difference(buf.view(), local["buf"]) or first_difference(check.view(), remote["out"])
    return {"transport": transport, "moved": moved, "mismatch": mismatch}


def until_error(engine: TransferEngine, spec: dict[str, Any]) -> dict[str, Any]:
    target, mem = spec["target"], spec["regions"]["mem"]
    chunk = min(8 << 20, mem["length"])
    buf = engine.register(bytearray(chunk))
    batches = 0
    while True:
        started = time.monotonic()
        try:
            engine.transfer([TransferRequest(TransferOp.READ, buf.address + off, 1 << 16, target, mem["address"] + off)
                             for off in range(0, chunk, 1 << 16)]).wait(timeout_s=WAIT_S)
        except TidekvError as exc:
            return {"batches": batches, "error_type": type(exc).__name__, "error": str(exc),
                    "failed_after_s": time.monotonic() - started}
        batches += 1
        if batches == 1:
            print(json.dumps({"looping": True}), flush=True)


def main() -> int:
    spec = json.loads(sys.argv[1])
    configure_logging("INFO")  # the engine says on stderr why it took the transport it took
    engine = TransferEngine()
    try:
        result = {"contract": contract, "until_error": until_error}[spec["mode"]](engine, spec)
    finally:
        engine.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
