"""KVLayout: byte runs from strides, block spans, and block-to-block transfers (checked byte for
byte through a real TransferEngine between two engines in this process)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is needed for KV-cache tensors")

from tidekv import TransferConfig, TransferEngine, TransferOp  # noqa: E402
from tidekv.errors import ConfigError  # noqa: E402
from tidekv.kvcache.layout import KVLayout, contiguous_runs  # noqa: E402


def test_contiguous_tensor_is_one_run() -> None:
    t = torch.zeros(8, 2, 32, 64)
    assert contiguous_runs(t.shape[1:], t.stride()[1:], 4) == [(0, 2 * 32 * 64 * 4)]


def test_permuted_tensor_has_one_run_per_head() -> None:
    base = torch.zeros(8, 32, 2, 64)  # NHD stored, viewed as HND
    view = base.permute(0, 2, 1, 3)
    runs = contiguous_runs(view.shape[1:], view.stride()[1:], 4)
    assert len(runs) == 2 * 32 and all(length == 64 * 4 for _, length in runs)
    covered = sorted(o for o, _ in runs)
    assert covered[0] == 0 and covered[-1] == (31 * 2 + 1) * 64 * 4


def test_spans_cover_exactly_the_block() -> None:
    t = torch.arange(4 * 2 * 4 * 8, dtype=torch.float32).reshape(4, 2, 4, 8)
    layout = KVLayout.from_tensors({"model.layers.0.attn": t}, block_size=4, model_tag="m")
    (addr, length), = layout.block_spans(2)
    assert addr == t[2].data_ptr() and length == t[2].numel() * 4
    with pytest.raises(ConfigError, match="out of range"):
        layout.block_spans(4)


def test_layers_are_ordered_by_index_and_fingerprint_tracks_shape() -> None:
    a = {f"model.layers.{i}.attn": torch.zeros(4, 2, 4, 8) for i in (10, 2, 1)}
    layout = KVLayout.from_tensors(a, block_size=4, model_tag="m")
    assert [lay.name for lay in layout.layers] == ["model.layers.1.attn", "model.layers.2.attn", "model.layers.10.attn"]
    other = KVLayout.from_tensors({k: torch.zeros(4, 2, 4, 16) for k in a}, block_size=4, model_tag="m")
    with pytest.raises(ConfigError, match="fingerprint"):
        layout.check_compatible(other)
    layout.check_compatible(KVLayout.from_wire(layout.to_wire()))


def test_memory_ranges_merge_views_of_one_buffer() -> None:
    big = torch.zeros(2, 8, 2, 4, 8)  # one buffer, a view per layer
    layout = KVLayout.from_tensors({"l.0": big[0], "l.1": big[1]}, block_size=4, model_tag="m")
    assert layout.memory_ranges() == [(big.data_ptr(), big.numel() * 4)]


@pytest.mark.parametrize("permuted", [False, True])
def test_block_requests_move_the_right_blocks(permuted: bool) -> None:
    def make(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {}
        for i in range(2):
            t = torch.randn(16, 4, 2, 8, generator=g)  # blocks, tokens, heads, content
            out[f"model.layers.{i}.attn"] = t.permute(0, 2, 1, 3) if permuted else t
        return out

    src, dst = make(1), make(2)
    with TransferEngine(config=TransferConfig()) as a, TransferEngine(config=TransferConfig()) as b:
        la = KVLayout.from_tensors(src, 4, "m")
        lb = KVLayout.from_tensors(dst, 4, "m")
        for addr, length in la.memory_ranges():
            a.register((addr, length))
        for addr, length in lb.memory_ranges():
            b.register((addr, length))
        reqs = lb.block_requests(TransferOp.READ, a.name, la, local_blocks=[5, 6, 9], remote_blocks=[1, 2, 3])
        # Blocks 5, 6 <- 1, 2 follow each other on both sides: their runs merge where they touch.
        runs_per_block = len(la.layers[0].runs)
        if runs_per_block == 1:
            assert len(reqs) == 2 * 2
        else:
            assert len(reqs) < 2 * 3 * runs_per_block
        b.transfer(reqs).wait(timeout_s=10)
    for name in src:
        for lb_, rb in zip([5, 6, 9], [1, 2, 3]):
            assert torch.equal(dst[name][lb_], src[name][rb])
        assert not torch.equal(dst[name][0], src[name][0])  # untouched blocks stay as they were


@pytest.mark.parametrize("permuted", [False, True])
def test_block_requests_cover_exactly_the_per_block_spans(permuted: bool) -> None:
    """The grouped requests move the same bytes as copying every run of every block one by one."""
    import random

    def make() -> dict[str, torch.Tensor]:
        t = [torch.empty(64, 4, 2, 8) for _ in range(3)]
        return {f"model.layers.{i}.attn": x.permute(0, 2, 1, 3) if permuted else x for i, x in enumerate(t)}

    local, remote = KVLayout.from_tensors(make(), 4, "m"), KVLayout.from_tensors(make(), 4, "m")
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(1, 20)
        lbs = sorted(rng.sample(range(64), n)) if rng.random() < 0.5 else list(range(s := rng.randint(0, 64 - n), s + n))
        rbs = list(range(s := rng.randint(0, 64 - n), s + n)) if rng.random() < 0.7 else rng.sample(range(64), n)
        reqs = local.block_requests(TransferOp.READ, "peer:1", remote, lbs, rbs)
        got = {(r.local_addr + i, r.remote_addr + i) for r in reqs for i in range(0, r.length, 32)}
        want = set()
        for mine, theirs in zip(local.layers, remote.layers):
            for lb, rb in zip(lbs, rbs):
                for (la, length), (ra, _) in zip(mine.spans(lb), theirs.spans(rb)):
                    want |= {(la + i, ra + i) for i in range(0, length, 32)}
        assert got == want
        assert sum(r.length for r in reqs) == len(lbs) * sum(lay.block_bytes for lay in local.layers)
    with pytest.raises(ConfigError, match="out of range"):
        local.block_requests(TransferOp.READ, "peer:1", remote, [63, 64], [0, 1])


class _OnDevice:
    """A tensor's layout facts with a claimed device (no GPU needed to check the bookkeeping)."""

    def __init__(self, tensor: torch.Tensor, device: str) -> None:
        self._t, self.device = tensor, torch.device(device)
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()

    def stride(self) -> tuple[int, ...]:
        return self._t.stride()

    def element_size(self) -> int:
        return self._t.element_size()


def test_layout_knows_where_the_cache_is_and_keeps_it_out_of_the_fingerprint() -> None:
    host = {"l.0": torch.zeros(4, 2, 4, 16), "l.1": torch.zeros(4, 2, 4, 16)}
    on_gpu = {k: _OnDevice(t, "cuda:1") for k, t in host.items()}
    cpu_layout = KVLayout.from_tensors(host, 4, "m")
    gpu_layout = KVLayout.from_tensors(on_gpu, 4, "m")
    assert (cpu_layout.location, gpu_layout.location) == ("cpu", "cuda:1")
    assert cpu_layout.fingerprint == gpu_layout.fingerprint  # a GPU decode may pull from a CPU prefill
    mixed = {"l.0": _OnDevice(host["l.0"], "cuda:0"), "l.1": _OnDevice(host["l.1"], "cuda:1")}
    with pytest.raises(ConfigError, match=r"spread over \['cuda:0', 'cuda:1'\]"):
        KVLayout.from_tensors(mixed, 4, "m")
    with pytest.raises(ConfigError, match="tidekv moves cpu and cuda memory"):
        KVLayout.from_tensors({"l.0": _OnDevice(host["l.0"], "meta")}, 4, "m")
