"""What the SGLang integration tests and ``benchmarks/sglang_hicache.py`` share: the CPU import
shim for torchvision, real SGLang host pools built on CPU, SGLang storage configs, page hashes,
and a ``tidekv up`` pool in a child process.

Why the torchvision shim: ``sglang.srt.mem_cache.pool_host`` (the host pools) and
``sglang.srt.disaggregation.mooncake`` import ``sglang.srt.configs``, which imports
``torchvision.transforms`` for multimodal preprocessing. PyPI's torchvision is a CUDA build that
fails against CPU torch (``operator torchvision::nms does not exist``) and the CPU wheel index is
not reachable here, so ``.venv-sglang`` has none; ``stub_torchvision()`` makes every
``torchvision.*`` import yield an inert module. Nothing on the paths under test calls into it.
SGLang and tidekv themselves are never stubbed.

This module imports no sglang and no torch at import time (callers stub torchvision first).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tidekv-test/tiny-llama"


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _InertModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+tidekv.stub"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def stub_torchvision() -> bool:
    """Makes ``import torchvision...`` succeed with inert modules when no torchvision is installed.

    Returns whether the stub was installed (False: a real torchvision is there, or already stubbed).
    """
    if any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
        return False
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.insert(0, _TorchvisionStub())
    return True


# ---- host pools ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolShape:
    """Geometry of a host pool: a small model's KV per token, ``pages`` pages of ``page_size`` tokens."""

    layers: int = 4
    heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    pages: int = 64
    dtype: str = "bfloat16"
    layout: str = "page_first"
    is_mla: bool = False
    kv_lora_rank: int = 64  # MLA only
    qk_rope_head_dim: int = 32  # MLA only

    @property
    def page_bytes(self) -> int:
        import torch

        item = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        if self.is_mla:
            return self.layers * self.page_size * (self.kv_lora_rank + self.qk_rope_head_dim) * item
        return 2 * self.layers * self.page_size * self.heads * self.head_dim * item


def make_host_pool(shape: PoolShape) -> Any:
    """A real SGLang host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) on CPU.

    The device pool it mirrors is described with plain CPU tensors, which is all the host pool's
    constructor reads from it. ``pool.kv_buffer`` holds ``shape.pages`` pages plus SGLang's
    padding page.
    """
    import torch

    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo

    dtype = getattr(torch, shape.dtype)
    device_tokens = shape.pages * shape.page_size // 2  # a host pool larger than the device pool, as in serving
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=device_tokens, start_layer=0,
                  end_layer=shape.layers - 1, host_token_capacity=shape.pages * shape.page_size)
    if shape.is_mla:
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        return _make_mla_pool(MLATokenToKVPoolHost, shape, dtype, common)
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(device_tokens, shape.heads, shape.head_dim, dtype=dtype) for _ in range(shape.layers))
    v = tuple(torch.zeros(device_tokens, shape.heads, shape.head_dim, dtype=dtype) for _ in range(shape.layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                          layout=KVBufferLayout.NHD),
        page_size=shape.page_size, head_num=shape.heads, head_dim=shape.head_dim, v_head_dim=shape.head_dim,
        dtype=dtype, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 1.0, 0, shape.page_size, shape.layout, **common)
    pool._device_k = k, v  # the device tensors the pool's pointer tables point into stay alive with it
    return pool


def _make_mla_pool(cls: Any, shape: PoolShape, dtype: Any, common: dict[str, Any]) -> Any:
    import torch

    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo

    dim = shape.kv_lora_rank + shape.qk_rope_head_dim
    rows = tuple(torch.zeros(common["device_capacity_tokens"], 1, dim, dtype=dtype) for _ in range(shape.layers))
    info = MLABufferInfo(buffers=rows, data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
                         layer_indices=tuple(range(shape.layers)), device_layer_num=shape.layers,
                         page_size=shape.page_size, kv_lora_rank=shape.kv_lora_rank,
                         qk_rope_head_dim=shape.qk_rope_head_dim, kv_cache_dim=dim, dtype=dtype,
                         device=torch.device("cpu"))
    pool = cls(info, 1.0, 0, shape.page_size, shape.layout, target_layer_num=shape.layers, **common)
    pool._device_rows = rows  # the device tensors the pool's pointer tables point into stay alive with it
    return pool


def fill_pages(pool: Any, pages: list[int], seed: int) -> None:
    """Writes reproducible bytes into whole pages of ``pool.kv_buffer`` (by page number)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for page in pages:
        for part in page_views(pool, page):
            part.copy_(torch.randint(0, 256, (part.numel(),), dtype=torch.uint8, generator=gen))


def page_views(pool: Any, page: int) -> list[Any]:
    """The uint8 views of one page's K/V objects in ``pool``, in ``get_page_buffer_meta`` order."""
    import torch

    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * pool.page_size, (page + 1) * pool.page_size))
    base = pool.kv_buffer.data_ptr()
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    assert all(base <= p and p + n <= base + flat.numel() for p, n in zip(ptrs, sizes)), "pointer outside kv_buffer"
    return [flat[p - base:p - base + n] for p, n in zip(ptrs, sizes)]


def page_bytes(pool: Any, page: int) -> bytes:
    """The bytes of one page's objects, concatenated."""
    return b"".join(bytes(v.numpy()) for v in page_views(pool, page))


def host_indices(pool: Any, pages: list[int]) -> Any:
    """The host-pool token slots of ``pages`` (what SGLang passes as ``host_indices``)."""
    import torch

    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages]) if pages \
        else torch.empty(0, dtype=torch.int64)


# ---- storage configs and keys -------------------------------------------------------------


def storage_config(extra_config: dict[str, Any] | None, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                   pp_size: int = 1, is_mla: bool = False, model_name: str | None = MODEL_NAME,
                   enable_metrics: bool = False) -> Any:
    """A ``HiCacheStorageConfig`` as SGLang's cache controller builds it for one rank."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=enable_metrics,
                                is_page_first_layout=True, model_name=model_name,
                                extra_config=None if extra_config is None else dict(extra_config))


def tidekv_extra_config(master: str, **settings: Any) -> dict[str, Any]:
    """The extra config that selects the tidekv backend through SGLang's dynamic factory."""
    return {"backend_name": "tidekv", "module_path": "tidekv_sglang.hicache", "class_name": "TidekvHiCacheStorage",
            "interface_v1": 1, "master": master, **settings}


def mooncake_extra_config(master: str, **settings: Any) -> dict[str, Any]:
    """The extra config of SGLang's own ``mooncake`` backend, pointed at a tidekv master (through
    the Mooncake drop-in); this process holds no pool memory unless ``global_segment_size`` says so."""
    return {"master_server_address": master, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE",
            "local_hostname": "127.0.0.1", "global_segment_size": 0, **settings}


def page_hashes(count: int, seed: int) -> list[str]:
    """``count`` page hashes chained like SGLang's (sha256 over the previous digest and the page's token ids)."""
    out, prev = [], b""
    for i in range(count):
        tokens = b"".join(int.to_bytes((seed * 1_000_003 + i * 16 + t) % (1 << 32), 4, "little") for t in range(16))
        digest = hashlib.sha256(prev + tokens)
        out.append(digest.hexdigest())
        prev = digest.digest()
    return out


def swap_pages_with(peer: LineChild, backend: Any, pool: Any) -> None:
    """A peer process (``hicache_peer.py``) and this one read each other's pages through their
    HiCache backends, byte for byte: the peer writes four pages (into its own segment first) and
    ``backend`` reads them into ``pool``; then ``backend`` writes four and the peer reads them."""
    theirs, ours = page_hashes(4, seed=20), page_hashes(4, seed=21)
    reply = peer.call("set", pages=[0, 1, 2, 3], hashes=theirs, seed=1)
    assert reply["results"] == [True] * 4
    assert backend.batch_exists(theirs) == 4
    assert backend.batch_get_v1(theirs, host_indices(pool, [10, 11, 12, 13])) == [True] * 4
    assert [hashlib.sha256(page_bytes(pool, p)).hexdigest() for p in (10, 11, 12, 13)] == reply["digests"]
    fill_pages(pool, [20, 21, 22, 23], seed=2)
    assert backend.batch_set_v1(ours, host_indices(pool, [20, 21, 22, 23])) == [True] * 4
    got = peer.call("get", pages=[30, 31, 32, 33], hashes=ours)
    assert got["results"] == [True] * 4
    assert got["digests"] == [hashlib.sha256(page_bytes(pool, p)).hexdigest() for p in (20, 21, 22, 23)]


# ---- a tidekv pool in a child process -----------------------------------------------------


@dataclass
class TidekvUp:
    """``python -m tidekv up`` (a master plus one storage segment) in a child process on a free port.

    Use as a context manager; ``master`` is the address SGLang's extra config points at.
    """

    log_path: Path
    segment_size: str = "256MiB"
    extra_args: tuple[str, ...] = ()
    """More ``tidekv up`` flags (``--lease-ttl-s 2``, ...)."""
    master: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def __enter__(self) -> TidekvUp:
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in __exit__)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidekv", "up", "--port", "0", "--metrics-port", "-1",
             "--segment-size", self.segment_size, *self.extra_args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=self._log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        assert self.proc.stdout is not None
        line = _read_line(self.proc.stdout, 60.0)
        if not line.startswith("tidekv is up: "):
            self.__exit__()
            raise RuntimeError(f"`tidekv up` did not start: {line!r}; log:\n{self.log_text()}")
        self.master = json.loads(line.removeprefix("tidekv is up: "))["master"]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _read_line(stream: Any, timeout_s: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    buf = b""
    try:
        while b"\n" not in buf:
            if not sel.select(timeout_s):
                return buf.decode(errors="replace")
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
    finally:
        sel.close()
    return buf.partition(b"\n")[0].decode(errors="replace")


class LineChild:
    """A ``python <script> <json spec>`` child in this folder: first stdout line is its hello, then one
    JSON answer per JSON command line. Every answer is awaited with a deadline. ``python`` is
    the interpreter (default: this one)."""

    def __init__(self, script: str, spec: dict[str, Any], log_path: Path, env: dict[str, str] | None = None,
                 start_timeout_s: float = 60.0, python: str | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            [python or sys.executable, str(Path(__file__).with_name(script)), json.dumps(spec)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        line = self._line(start_timeout_s)
        try:
            self.hello = json.loads(line)
        except ValueError:
            self.stop()
            raise RuntimeError(f"{script} did not start: {line!r}; log:\n{self.log_text()}") from None

    def call(self, cmd: str, timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self.proc.stdin.flush()
        line = self._line(timeout_s)
        try:
            reply = json.loads(line)
        except ValueError:
            raise RuntimeError(f"no answer to {cmd!r} ({line!r}); log:\n{self.log_text()}") from None
        if not reply.get("ok"):
            raise RuntimeError(f"{cmd!r} failed: {reply.get('error')}; log:\n{self.log_text()}")
        return reply

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _line(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        return _read_line(self.proc.stdout, timeout_s)
