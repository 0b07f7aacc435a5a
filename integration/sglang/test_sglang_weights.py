"""RL weight updates through SGLang's own update path: ``update_weights_from_tensor`` with
tidekv's custom loader, run by SGLang's real ``WeightUpdater`` (what each TP worker runs; a
whole SGLang server does not run on this CPU machine), pulling from a trainer process."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import sglang_rig
import torch

CTX = multiprocessing.get_context("spawn")


class Toy(torch.nn.Module):
    """A model with SGLang's ``load_weights(iterable of (name, tensor))`` contract."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(64, 32), requires_grad=False)
        self.proj = torch.nn.Parameter(torch.zeros(32, 32, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            getattr(self, name.removeprefix("model.")).data.copy_(tensor)


def trainer_weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"model.embed": torch.randn(64, 32, generator=g),
            "model.proj": torch.randn(32, 32, generator=g).to(torch.bfloat16)}


def trainer_main(conn: Any, version: int) -> None:
    from tidekv.weights import Publisher

    with Publisher(trainer_weights(version)) as pub:
        pub.publish(version)
        conn.send(pub.address)
        conn.recv()


@pytest.fixture
def trainer() -> Iterator[Any]:
    procs = []

    def start(version: int) -> tuple[str, Any]:
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=trainer_main, args=(child, version), daemon=True)
        proc.start()
        procs.append((proc, parent))  # the trainer serves until its pipe closes
        assert parent.poll(60)
        return parent.recv(), proc

    yield start
    for proc, _ in procs:
        proc.kill()
        proc.join(5)


@pytest.fixture
def updater() -> tuple[Any, Toy]:
    sglang_rig.stub_torchvision()
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        WeightUpdater,
    )
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs
    from tidekv_sglang.weights import LOADER

    get_context().set_server_args(ServerArgs(model_path="unused", device="cpu", custom_weight_loader=[LOADER]))
    get_parallel().override_permanently(tp_rank=0)
    model = Toy()
    updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={LOADER: None},
                            get_model=lambda: model, update_model_fields=None, recapture_cuda_graph=None,
                            get_model_runner=None)
    return updater, model


def test_sglang_weight_updater_pulls_through_tidekv(updater: Any, trainer: Any) -> None:
    from tidekv_sglang.weights import LOADER, request_entries

    runner, model = updater
    address, _ = trainer(3)
    ok, message = runner.update_weights_from_tensor(request_entries(address, 3), load_format=LOADER)
    assert ok, message
    want = trainer_weights(3)
    assert torch.equal(model.embed, want["model.embed"]) and torch.equal(model.proj, want["model.proj"])


def test_dead_trainer_fails_the_update_and_keeps_the_weights(updater: Any, trainer: Any) -> None:
    from tidekv.config import WeightsConfig
    from tidekv.errors import PublisherUnavailableError
    from tidekv_sglang import weights

    runner, model = updater
    address, proc = trainer(4)
    proc.kill()
    proc.join(5)
    before = {n: p.clone() for n, p in model.named_parameters()}
    weights._subscribers[address] = weights.Subscriber(address, config=WeightsConfig(rpc_timeout_s=0.5))
    with pytest.raises(PublisherUnavailableError):
        runner.update_weights_from_tensor(weights.request_entries(address, 4), load_format=weights.LOADER)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_http_payload_carries_the_request_through_sglang_serializer() -> None:
    sglang_rig.stub_torchvision()
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from tidekv_sglang.weights import LOADER, UpdateRequest, update_request_payload

    monkey_patch_torch_reductions()  # as SGLang's workers (and verl-style senders) have it
    body = update_request_payload("10.0.0.7:5555", 9, wait_s=5.0, tp_size=2)
    assert body["load_format"] == LOADER and len(body["serialized_named_tensors"]) == 2
    (name, tensor), = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][1])  # SGLang's safe unpickler
    assert UpdateRequest.parse(name) == UpdateRequest("10.0.0.7:5555", 9, 5.0)
    assert tensor.to("cpu").numel() == 0  # what SGLang's worker does to each entry


def test_malformed_requests_are_refused() -> None:
    from tidekv.errors import ConfigError
    from tidekv_sglang.weights import UpdateRequest, load_from_tidekv

    with pytest.raises(ConfigError, match="host:port"):
        UpdateRequest("nowhere")
    with pytest.raises(ConfigError, match="must be an int"):
        UpdateRequest("h:1", version="7")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a tidekv weight-update request"):
        load_from_tidekv(Toy(), [("model.embed", torch.zeros(64, 32))])
    with pytest.raises(ConfigError, match="version must be an int"):
        UpdateRequest.parse("tidekv://h:1?version=x")
    with pytest.raises(ConfigError, match="one request entry"):
        load_from_tidekv(Toy(), [("a", torch.empty(0)), ("b", torch.empty(0))])
