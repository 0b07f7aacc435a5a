"""The trainer side of the RL weight-update tests: a process that publishes a model's weights
(read from its safetensors file) with ``tidekv.weights.Publisher``.

``trainer_main(conn, model_dir, version, die)`` answers ``("ready", address)``, then publishes
``version``. With ``die`` it copies a third of the snapshot in, waits until a receiver has
joined the pull, and SIGKILLs itself -- a trainer dying mid-update.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path


def trainer_main(conn: Connection, model_dir: str, version: int, die: bool) -> None:
    from safetensors.torch import load_file
    from tidekv.config import WeightsConfig
    from tidekv.weights import Publisher, layout

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    pub = Publisher(tensors, config=WeightsConfig(chunk_bytes=64 << 10))
    conn.send(("ready", pub.address))
    if die:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        real_pack = layout.pack

        def pack(buffer, specs, pairs, progress=None, piece_bytes=16 << 20):  # type: ignore[no-untyped-def]
            def on_progress(end: int) -> None:
                if progress is not None:
                    progress(end)
                if end > total // 3:
                    deadline = time.monotonic() + 300
                    while not pub._versions[version].receivers and time.monotonic() < deadline:
                        time.sleep(0.05)
                    time.sleep(0.3)
                    os.kill(os.getpid(), signal.SIGKILL)

            real_pack(buffer, specs, pairs, on_progress, piece_bytes)

        layout.pack = pack  # type: ignore[assignment]
    pub.publish(version)
    conn.send(("published", version))
    conn.recv()  # serve until the test is done
    pub.close()
