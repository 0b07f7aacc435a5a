"""Weight broadcast with GPU tensors on both ends: the publisher copies device tensors down into
its snapshot, a subscriber fills device destinations. Needs a CUDA device (skips without one)."""

from __future__ import annotations

import pytest
import torch

from tidekv.config import WeightsConfig
from tidekv.weights import Publisher, Subscriber

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]


def test_gpu_tensors_round_trip_through_a_version() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    trainer = {
        "embed": torch.randn(4096, 1024, device="cuda", generator=g).to(torch.bfloat16),
        "proj": torch.randn(1024, 1024, device="cuda", generator=g),
        "bias": torch.randn(1024, device="cuda", generator=g).to(torch.float16),
    }
    with Publisher(trainer, config=WeightsConfig(chunk_bytes=1 << 20)) as pub, Subscriber(pub.address) as sub:
        pub.publish(1)
        dest = {n: torch.empty_like(t) for n, t in trainer.items()}
        pulled = sub.pull(1, into=dest)
        torch.cuda.synchronize()
        for name, t in trainer.items():
            assert dest[name].device.type == "cuda"
            assert torch.equal(dest[name], t), name
            assert torch.equal(pulled.tensors[name], t.cpu()), name
