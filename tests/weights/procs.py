"""Processes for the weights tests: a publisher and subscribers, each in its own interpreter.

Each entry point is a top-level function run with multiprocessing's spawn method; it talks to
the test over a pipe. Tensors are derived from (seed, version) so any process can check them.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from tidekv.config import WeightsConfig
from tidekv.weights import Publisher, Subscriber

SHAPES: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    ("embed.weight", (512, 256), torch.bfloat16),
    ("layers.0.attn.weight", (256, 256), torch.float32),
    ("layers.0.norm.weight", (256,), torch.float16),
    ("layers.0.step", (), torch.int64),
    ("layers.1.mlp.weight", (700, 256), torch.bfloat16),
    ("empty", (0, 4), torch.float32),
    ("lm_head.weight", (512, 256), torch.bfloat16),
]


def make_tensors(version: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """The tensors of ``version``: integers in [0, 100) drawn from the version as seed (exact in
    every dtype used), so a tensor of another version, or at another offset, never compares equal."""
    g = torch.Generator().manual_seed(version)
    out = {}
    for name, shape, dtype in SHAPES:
        if shape and scale > 1:
            shape = (shape[0] * scale, *shape[1:])
        out[name] = torch.full(shape, version, dtype=dtype) if name.endswith("step") else torch.randint(0, 100, shape, generator=g).to(dtype)
    return out


def subscriber_main(conn: Connection, address: str, config: dict[str, Any], pause_after_chunks: int = 0) -> None:
    """Pulls each version the test sends; replies (version, from_parent_bytes, equal?) or an error name.

    With ``pause_after_chunks``, a pull stops for good once it holds that many chunks, after
    sending ("paused", chunks): its engine still serves them to its children, it never finishes."""
    if pause_after_chunks:
        from tidekv.weights import layout

        real_set_progress = layout.set_progress

        def set_progress(view: memoryview, chunks_done: int, state: int) -> None:
            real_set_progress(view, chunks_done, state)
            if state == layout.STATE_FILLING and chunks_done >= pause_after_chunks:
                conn.send(("paused", chunks_done))
                while True:
                    time.sleep(60)

        layout.set_progress = set_progress  # type: ignore[assignment]
    with Subscriber(address, config=WeightsConfig(**config)) as sub:
        conn.send(("ready", sub.engine.name))
        while (msg := conn.recv()) is not None:
            version, scale = msg
            try:
                pulled = sub.pull(version, wait_s=30.0)
            except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on the type
                conn.send(("error", type(exc).__name__, str(exc)))
                continue
            want = make_tensors(pulled.version, scale)
            equal = all(torch.equal(pulled.tensors[n], t) for n, t in want.items()) and len(pulled.tensors) == len(want)
            conn.send(("pulled", pulled.version, pulled.from_parent_bytes, equal))


def publisher_main(conn: Connection, config: dict[str, Any], scale: int) -> None:
    """Publishes the versions the test sends; ``("kill_at", fraction)`` SIGKILLs itself mid-copy."""
    tensors = make_tensors(1, scale)
    with Publisher(tensors, config=WeightsConfig(**config)) as pub:
        conn.send(("ready", pub.address))
        while (msg := conn.recv()) is not None:
            op, version = msg
            for name, t in make_tensors(version, scale).items():
                tensors[name].copy_(t)
            if op == "publish":
                pub.publish(version)
                conn.send(("published", version))
            elif op == "die_mid_publish":
                total = sum(t.numel() * t.element_size() for t in tensors.values())

                def die(end: int, _total: int = total) -> None:
                    if end > _total // 3:
                        os.kill(os.getpid(), signal.SIGKILL)

                from tidekv.weights import layout

                real_pack = layout.pack
                layout.pack = lambda buf, specs, pairs, progress=None, piece_bytes=1 << 20: real_pack(  # type: ignore[assignment]
                    buf, specs, pairs, lambda end: (progress and progress(end), die(end), time.sleep(0.01)), piece_bytes)
                pub.publish(version)
