"""A weights publisher or subscriber (``tidekv.weights``) run on a rig host, driven by
``tests.childproc.JsonLineChild`` (one JSON line per command in, one per answer out).

``python -m tests.multihost.weights_main '<spec>'``; the spec's "role" says which:

- ``publisher``: ``Publisher(make_tensors(1, scale), host=spec["host"], config=WeightsConfig(**spec["config"]))``.
  Hello: its control address and engine name. ``publish {version}`` copies
  ``make_tensors(version, scale)`` into the published tensors and publishes them.
- ``subscriber``: ``Subscriber(spec["publisher"], config=WeightsConfig(**spec["config"]))``.
  Hello: its engine name. ``pull {version, progress_bytes}`` pulls the version and checks every
  tensor (names in order, dtype, shape, then every byte) against ``make_tensors(version, scale)``;
  with ``progress_bytes`` it first answers ``{"progress": bytes}`` once its engine has read that
  many bytes during the pull (so the test can act mid-pull), then the pull's outcome.

Tensors come from ``tests.weights.procs.make_tensors``: any process derives a version's bytes
from its number. Checks run here because the pytest process is on none of the rig's hosts.
Neighbours: ``test_weights_hosts`` (drives it), ``tests/weights/test_weights.py`` (one host).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch
from tidekv.config import WeightsConfig
from tidekv.weights import Publisher, PulledWeights, Subscriber

from tests.transfer.reference import first_difference
from tests.weights.procs import make_tensors

logger = logging.getLogger("weights_main")

PROGRESS_POLL_S = 0.002


class Output:
    """stdout, one JSON line per write, safe from two threads (a pull's progress and its answer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, obj: dict[str, Any]) -> None:
        with self._lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()


def mismatch(pulled: PulledWeights, version: int, scale: int) -> str | None:
    """None when ``pulled`` is exactly ``make_tensors(version, scale)``, else what differs first."""
    want = make_tensors(version, scale)
    if pulled.version != version:
        return f"pulled version {pulled.version}, asked for {version}"
    if list(pulled.tensors) != list(want):
        return f"tensor names {list(pulled.tensors)} != {list(want)}"
    for name, expected in want.items():
        got = pulled.tensors[name]
        if got.dtype != expected.dtype or got.shape != expected.shape:
            return f"{name}: {got.dtype}{list(got.shape)} != {expected.dtype}{list(expected.shape)}"
        difference = first_difference(_raw(got), _raw(expected))
        if difference is not None:
            return f"{name}: {difference}"
    return None


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _watch_progress(sub: Subscriber, start_bytes: int, threshold: int, done: threading.Event, out: Output) -> None:
    while not done.is_set():
        read = sub.engine.stats()["bytes_read"] - start_bytes
        if read >= threshold:
            out.write({"progress": read})
            return
        time.sleep(PROGRESS_POLL_S)


def pull(sub: Subscriber, cmd: dict[str, Any], scale: int, out: Output) -> dict[str, Any]:
    version: int = cmd["version"]
    done = threading.Event()
    watcher = None
    if cmd.get("progress_bytes"):
        watcher = threading.Thread(target=_watch_progress, daemon=True,
                                   args=(sub, sub.engine.stats()["bytes_read"], cmd["progress_bytes"], done, out))
        watcher.start()
    started = time.monotonic()
    try:
        pulled = sub.pull(version, wait_s=cmd.get("wait_s", 0.0))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on the type
        logger.warning("pull of version %d failed:\n%s", version, traceback.format_exc())
        return {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                "failed_after_s": time.monotonic() - started}
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    return {"ok": True, "version": pulled.version, "nbytes": pulled.nbytes, "seconds": pulled.seconds,
            "from_parent_bytes": pulled.from_parent_bytes, "mismatch": mismatch(pulled, version, scale)}


def run_publisher(spec: dict[str, Any], out: Output) -> None:
    scale = spec["scale"]
    tensors = make_tensors(1, scale)
    with Publisher(tensors, host=spec.get("host"), config=WeightsConfig(**spec.get("config", {}))) as pub:
        out.write({"address": pub.address, "engine": pub.engine.name, "pid": os.getpid()})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                out.write({"ok": True})
                return
            assert cmd["cmd"] == "publish", cmd
            for name, t in make_tensors(cmd["version"], scale).items():
                tensors[name].copy_(t)
            out.write({"ok": True, "version": pub.publish(cmd["version"])})


def run_subscriber(spec: dict[str, Any], out: Output) -> None:
    with Subscriber(spec["publisher"], config=WeightsConfig(**spec.get("config", {}))) as sub:
        out.write({"engine": sub.engine.name, "pid": os.getpid()})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                out.write({"ok": True})
                return
            assert cmd["cmd"] == "pull", cmd
            out.write(pull(sub, cmd, spec["scale"], out))


def main() -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(sys.argv[1])
    {"publisher": run_publisher, "subscriber": run_subscriber}[spec["role"]](spec, Output())
    return 0


if __name__ == "__main__":
    sys.exit(main())
