"""Checks of the cuda transport, on the fake driver or a real GPU; each runs in a process of its own.

``python -m tests.cuda_fake.scenarios NAME`` runs one and exits non-zero with the failing
assertion: on the fake driver when ``TIDEKV_LIBCUDA`` names it, else on the host's GPUs (one GPU
is enough: what needs two is skipped there). ``serve`` is the target process the two-process
ones start. Neighbours: ``tests/transfer/test_cuda_fake.py`` and ``test_cuda_gpu.py`` (run
them), ``tests.cuda_fake`` (the fake), ``tidekv.bench.gpumem`` (GPU memory without torch).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from tidekv import (
    ConfigError,
    SegmentNotRegisteredError,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
)
from tidekv.bench.gpumem import DeviceMemory
from tidekv.config import TransportKind

SIZE = 1 << 20
FAKE = bool(os.environ.get("TIDEKV_LIBCUDA"))
BLOCK = 16 << 10
BLOCKS = 2000
WAIT_S = 30.0


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def expect(error: type[BaseException], fn: Callable[[], Any], *needles: str) -> str:
    """Runs fn, which must raise `error` whose text holds every needle; returns the text."""
    try:
        fn()
    except error as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{needle!r} not in {error.__name__}: {text}"
        return text
    raise AssertionError(f"{error.__name__} not raised")


def move(engine: TransferEngine, op: TransferOp, local: int, peer: str, remote: int, size: int) -> None:
    engine.transfer([TransferRequest(op, local, size, peer, remote)]).wait(timeout_s=WAIT_S)


# -- one process -------------------------------------------------------------------------------


def registration() -> None:
    """What register() takes as GPU memory, and what it refuses, naming why."""
    cuda = DeviceMemory()
    engine = TransferEngine()
    try:
        status = {name: (ok, why) for name, ok, why in engine.transports()}
        names = "2 GPU(s): cuda:0 Fake GPU 0, cuda:1 Fake GPU 1" if FAKE else f"{cuda.devices} GPU(s): cuda:0 "
        assert status["cuda"][0] and names in status["cuda"][1], status
        other = 1 if cuda.devices > 1 else 0
        whole = cuda.alloc(SIZE)
        region = engine.register((whole, SIZE), location="cuda:0")
        assert region.location == "cuda:0"
        expect(ConfigError, region.view, "cuda:0 memory")
        # A pointer inside an allocation (a caching-allocator block) registers as well.
        inner = cuda.alloc(SIZE)
        assert engine.register((inner + 4096, SIZE - 8192), location="cuda").location == "cuda"
        host = bytearray(SIZE)
        expect(ConfigError, lambda: engine.register(host, location="cuda:0"), "cpu memory", "location='cuda:0'")
        import ctypes
        host_addr = ctypes.addressof(ctypes.c_char.from_buffer(host))
        expect(ConfigError, lambda: engine.register((host_addr, SIZE), location="cuda:0"), "not GPU memory")
        elsewhere = cuda.alloc(SIZE, device=other)
        if other:
            expect(ConfigError, lambda: engine.register((elsewhere, SIZE), location="cuda:0"), "on cuda:1, not on cuda:0")
        expect(ConfigError, lambda: engine.register((elsewhere, SIZE), location="cuda:77"),
               f"cuda:77 does not exist here ({cuda.devices} GPU(s))")
        if FAKE:  # (a real driver may place another allocation right behind it)
            # Past the end of its allocation: refused, the allocation is all the driver vouches for.
            tail = cuda.alloc(SIZE)
            expect(ConfigError, lambda: engine.register((tail, SIZE + 4096), location="cuda:0"), "not GPU memory")

        class ArrayLike:  # __cuda_array_interface__ (CuPy, Numba, ...): the device comes from the driver
            def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None = None) -> None:
                self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "<f4",
                                                 "strides": strides, "version": 3}

        array = cuda.alloc(SIZE, device=other)
        got = engine.register(ArrayLike(array, (SIZE // 4,)))
        assert (got.address, got.length, got.location) == (array, SIZE, f"cuda:{other}"), got
        expect(ConfigError, lambda: engine.register(ArrayLike(cuda.alloc(SIZE), (256, 256), (4, 1024))),
               "non-contiguous")
        if FAKE:
            dlpack_registration(engine, cuda)
    finally:
        engine.close()


def dlpack_registration(engine: TransferEngine, cuda: DeviceMemory) -> None:
    """A DLPack CUDA producer: a CPU tensor lends its capsule, pointed at fake GPU memory."""
    import ctypes

    import torch

    lender = torch.zeros(SIZE // 2, dtype=torch.float16)
    gpu = cuda.alloc(SIZE)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]

    class DLPackCuda:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)  # kDLCUDA, device 0

        def __dlpack__(self, **kwargs: Any) -> Any:
            capsule = lender.__dlpack__()
            ctypes.c_void_p.from_address(get(capsule, b"dltensor")).value = gpu  # DLTensor.data
            return capsule

    got = engine.register(DLPackCuda())
    assert (got.address, got.length, got.location) == (gpu, SIZE, "cuda:0"), got


def in_process() -> None:
    """Two engines of one process: cuda<->cuda across devices and cuda<->cpu, byte for byte."""
    cuda = DeviceMemory()
    a, b = TransferEngine(), TransferEngine()
    try:
        other = 1 if cuda.devices > 1 else 0
        a_gpu, b_gpu = cuda.alloc(SIZE, device=0), cuda.alloc(SIZE, device=other)
        cuda.write(b_gpu, pattern(1, SIZE))
        a.register((a_gpu, SIZE), location="cuda:0")
        b.register((b_gpu, SIZE), location=f"cuda:{other}")
        host = a.register(bytearray(SIZE))
        move(a, TransferOp.READ, a_gpu, b.name, b_gpu, SIZE)
        assert cuda.read(a_gpu, SIZE) == pattern(1, SIZE)
        host.view()[:] = pattern(2, SIZE)
        move(a, TransferOp.WRITE, host.address, b.name, b_gpu, SIZE)
        assert cuda.read(b_gpu, SIZE) == pattern(2, SIZE)
        move(a, TransferOp.READ, host.address + 4096, b.name, b_gpu + 8192, 100_000)
        assert bytes(host.view()[4096:4096 + 100_000]) == pattern(2, SIZE)[8192:8192 + 100_000]
        # GPU -> peer's host memory in this process.
        b_host = b.register(bytearray(SIZE))
        cuda.write(a_gpu, pattern(3, SIZE))
        move(a, TransferOp.WRITE, a_gpu, b.name, b_host.address, SIZE)
        assert bytes(b_host.view()) == pattern(3, SIZE)
        assert a.stats()["cuda_bytes"] == 3 * SIZE + 100_000
        # Host to host is still shm's.
        move(a, TransferOp.READ, host.address, b.name, b_host.address, SIZE)
        assert a.stats()["shm_bytes"] == SIZE
        assert a.connect(b.name) == "shm"
    finally:
        a.close()
        b.close()


def forced() -> None:
    """A forced transport that cannot carry a GPU request fails it, naming location, peer and why;
    forced tcp stages GPU memory through host memory on both sides instead."""
    cuda = DeviceMemory()
    target = TransferEngine()
    tcp = TransferEngine(config=TransferConfig(transport=TransportKind.TCP))
    shm = TransferEngine(config=TransferConfig(transport=TransportKind.SHM))
    only_cuda = TransferEngine(config=TransferConfig(transport=TransportKind.CUDA))
    try:
        remote = cuda.alloc(SIZE)
        cuda.write(remote, pattern(1, SIZE))
        target.register((remote, SIZE), location="cuda:0")
        target_host = target.allocate(SIZE)
        local = cuda.alloc(SIZE)
        tcp.register((local, SIZE), location="cuda:0")
        move(tcp, TransferOp.READ, local, target.name, remote, SIZE)
        assert cuda.read(local, SIZE) == pattern(1, SIZE)
        host = tcp.register(bytearray(SIZE))
        move(tcp, TransferOp.READ, host.address, target.name, remote, SIZE)
        assert bytes(host.view()) == pattern(1, SIZE)
        assert tcp.stats()["cuda_bytes"] == 0 and tcp.stats()["bytes_read"] == 2 * SIZE
        shm_gpu = cuda.alloc(SIZE)
        shm.register((shm_gpu, SIZE), location="cuda:0")
        expect(TransferError, lambda: move(shm, TransferOp.READ, shm_gpu, target.name, target_host.address, SIZE),
               "cuda:0", target.name, "forced", "shm copies host memory only")
        cuda_host = only_cuda.register(bytearray(SIZE))
        expect(TransferError, lambda: move(only_cuda, TransferOp.READ, cuda_host.address, target.name,
                                           target_host.address, SIZE), "both ranges are host memory")
    finally:
        for e in (target, tcp, shm, only_cuda):
            e.close()


# -- two processes ------------------------------------------------------------------------------


def serve() -> None:
    """The target process: GPU and host regions with known bytes; commands on stdin, JSON on stdout."""
    cuda = DeviceMemory()
    engine = TransferEngine()
    regions: dict[str, int] = {}
    sizes: dict[str, int] = {}
    registered: dict[str, Any] = {}
    other = 1 if cuda.devices > 1 else 0
    made = {
        "ipc": lambda n: cuda.alloc(n),
        "ipc1": lambda n: cuda.alloc(n, device=other),
        "vmm": lambda n: cuda.vmm_alloc(n),
        "vmm_private": lambda n: cuda.vmm_alloc(n, exportable=False),
    }
    big = BLOCKS * BLOCK * 2
    for seed, (name, size) in enumerate([("ipc", SIZE), ("ipc1", SIZE), ("vmm", SIZE), ("vmm_private", SIZE),
                                         ("blocks", big)], start=10):
        ptr = made.get(name, lambda n: cuda.alloc(n))(size)
        cuda.write(ptr, pattern(seed, size))
        device = other if name == "ipc1" else 0
        registered[name] = engine.register((ptr, size), location=f"cuda:{device}")
        regions[name], sizes[name] = ptr, size
    host = engine.allocate(SIZE)
    host.view()[:] = pattern(20, SIZE)
    plain = engine.register(bytearray(pattern(21, SIZE)))
    regions.update(host=host.address, plain=plain.address)
    sizes.update(host=SIZE, plain=SIZE)
    print(json.dumps({"name": engine.name, "regions": regions}), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "digest":
            data = bytes(host.view()) if arg == "host" else cuda.read(regions[arg], sizes[arg])
            print(json.dumps({"sha": hashlib.sha256(data).hexdigest()}), flush=True)
        elif command == "unregister":
            engine.unregister(registered[arg])
            print(json.dumps({"ok": True}), flush=True)
        elif command == "quit":
            break
    engine.close()


class Target:
    """A target process (``serve`` by default) and the regions it reported."""

    def __init__(self, args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cuda_fake.scenarios", *(args or ["serve"])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"target {args} exited with {self.proc.wait(timeout=30)} before reporting")
        self.hello: dict[str, Any] = json.loads(line)
        self.name: str = self.hello["name"]
        self.regions: dict[str, int] = self.hello["regions"]

    def ask(self, line: str) -> dict[str, Any]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask_quit()
        self.proc.wait(timeout=30)

    def ask_quit(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def two_process() -> None:
    """IPC (cudaMalloc'd), VMM (POSIX fd) and host memory of another process, byte for byte."""
    cuda = DeviceMemory()
    target = Target()
    engine = TransferEngine()
    try:
        r = target.regions
        local = cuda.alloc(SIZE)
        engine.register((local, SIZE), location="cuda:0")
        host = engine.register(bytearray(SIZE))
        for name, seed in (("ipc", 10), ("ipc1", 11), ("vmm", 12)):
            move(engine, TransferOp.READ, local, target.name, r[name], SIZE)
            assert cuda.read(local, SIZE) == pattern(seed, SIZE), name
            move(engine, TransferOp.READ, host.address, target.name, r[name], SIZE)  # cuda -> cpu
            assert bytes(host.view()) == pattern(seed, SIZE), name
            cuda.write(local, pattern(seed + 100, SIZE))
            move(engine, TransferOp.WRITE, local, target.name, r[name], SIZE)
            assert target.ask(f"digest {name}")["sha"] == sha(pattern(seed + 100, SIZE)), name
        # GPU <-> the peer's allocate()d host memory (mapped).
        move(engine, TransferOp.READ, local, target.name, r["host"], SIZE)
        assert cuda.read(local, SIZE) == pattern(20, SIZE)
        move(engine, TransferOp.WRITE, local + 4096, target.name, r["host"], 65536)
        expected = bytearray(pattern(20, SIZE))
        expected[:65536] = pattern(20, SIZE)[4096:4096 + 65536]
        assert target.ask("digest host")["sha"] == sha(bytes(expected))
        assert engine.stats()["cuda_bytes"] == 10 * SIZE + 65536
        # Out of the cuda transport's reach: VMM memory made without a shareable handle, plain
        # host memory of another process. Such requests go staged over tcp instead...
        for name, seed in (("vmm_private", 13), ("plain", 21)):
            move(engine, TransferOp.READ, local, target.name, r[name], SIZE)
            assert cuda.read(local, SIZE) == pattern(seed, SIZE), name
        assert engine.stats()["cuda_bytes"] == 10 * SIZE + 65536
        # ... and fail, naming both sides and why, where cuda is forced.
        only_cuda = TransferEngine(config=TransferConfig(transport=TransportKind.CUDA))
        try:
            forced_local = cuda.alloc(SIZE)
            only_cuda.register((forced_local, SIZE), location="cuda:0")
            expect(TransferError, lambda: move(only_cuda, TransferOp.READ, forced_local, target.name,
                                               r["vmm_private"], SIZE), "cuda:0", target.name, "POSIX-fd")
            expect(TransferError, lambda: move(only_cuda, TransferOp.READ, forced_local, target.name, r["plain"], SIZE),
                   "cuda:0", target.name, "did not allocate()")
        finally:
            only_cuda.close()
        # After the peer unregisters a GPU region, nothing of it is reachable, and this process
        # lets go of its IPC mapping (which would keep the peer's freed memory allocated).
        opened = cuda.lib.fake_ipc_open_count() if FAKE else None
        assert target.ask("unregister ipc")["ok"]
        expect(SegmentNotRegisteredError, lambda: move(engine, TransferOp.READ, local, target.name, r["ipc"], SIZE))
        if FAKE:
            time.sleep(1.1)  # links sweep at most once a second, when planning
            move(engine, TransferOp.READ, local, target.name, r["vmm"], SIZE)
            assert cuda.lib.fake_ipc_open_count() == opened - 1, (opened, cuda.lib.fake_ipc_open_count())
    finally:
        engine.close()
        target.close()


def scattered_blocks() -> None:
    """2,000 scattered 16 KiB blocks in one batch, GPU to GPU across processes (a KV hand-off)."""
    cuda = DeviceMemory()
    target = Target()
    engine = TransferEngine()
    try:
        size = BLOCKS * BLOCK * 2
        local = cuda.alloc(size)
        engine.register((local, size), location="cuda:0")
        order = list(range(2 * BLOCKS))
        random.Random(5).shuffle(order)
        remote_blocks, local_blocks = order[:BLOCKS], order[BLOCKS:]
        batch = [TransferRequest(TransferOp.READ, local + lb * BLOCK, BLOCK, target.name,
                                 target.regions["blocks"] + rb * BLOCK)
                 for lb, rb in zip(local_blocks, remote_blocks)]
        engine.transfer(batch).wait(timeout_s=WAIT_S)
        source = pattern(14, size)
        got = cuda.read(local, size)
        for lb, rb in zip(local_blocks, remote_blocks):
            assert got[lb * BLOCK:(lb + 1) * BLOCK] == source[rb * BLOCK:(rb + 1) * BLOCK], (lb, rb)
    finally:
        engine.close()
        target.close()


def staged() -> None:
    """GPU memory over tcp (what crosses hosts): staged through pinned memory on both sides, byte
    for byte, for batches of large and of scattered small requests, mixed with host memory, and
    for frames larger than the target's bounce memory."""
    cuda = DeviceMemory()
    target = Target()
    engines = [TransferEngine(config=TransferConfig(transport=TransportKind.TCP)),
               TransferEngine(config=TransferConfig(transport=TransportKind.TCP, slice_size_bytes=16 << 20))]
    try:
        r = target.regions
        size = BLOCKS * BLOCK * 2
        source = pattern(14, size)
        for engine in engines:
            local = cuda.alloc(size)
            engine.register((local, size), location="cuda:0")
            host = engine.register(bytearray(size))
            # 32 x 1 MiB GPU -> GPU, and a host request in the same batch.
            batch = [TransferRequest(TransferOp.READ, local + i * SIZE, SIZE, target.name, r["blocks"] + i * SIZE)
                     for i in range(32)]
            batch.append(TransferRequest(TransferOp.READ, host.address, SIZE, target.name, r["host"]))
            engine.transfer(batch).wait(timeout_s=WAIT_S)
            assert cuda.read(local, 32 * SIZE) == source[:32 * SIZE]
            assert bytes(host.view()[:SIZE]) == pattern(20, SIZE)
            # One 48 MiB READ and WRITE (larger than any bounce memory).
            move(engine, TransferOp.READ, local, target.name, r["blocks"], 48 << 20)
            assert cuda.read(local, 48 << 20) == source[:48 << 20]
            cuda.write(local, pattern(30, 48 << 20))
            move(engine, TransferOp.WRITE, local, target.name, r["blocks"], 48 << 20)
            expected = bytearray(source)
            expected[:48 << 20] = pattern(30, 48 << 20)
            assert target.ask("digest blocks")["sha"] == sha(bytes(expected))
            # 2,000 scattered 16 KiB blocks each way; host memory -> peer GPU too.
            order = list(range(2 * BLOCKS))
            random.Random(6).shuffle(order)
            pairs = list(zip(order[BLOCKS:], order[:BLOCKS]))
            engine.transfer([TransferRequest(TransferOp.READ, local + lb * BLOCK, BLOCK, target.name,
                                             r["blocks"] + rb * BLOCK) for lb, rb in pairs]).wait(timeout_s=WAIT_S)
            got = cuda.read(local, size)
            for lb, rb in pairs:
                assert got[lb * BLOCK:(lb + 1) * BLOCK] == expected[rb * BLOCK:(rb + 1) * BLOCK], (lb, rb)
            cuda.write(local, pattern(31, size))
            engine.transfer([TransferRequest(TransferOp.WRITE, local + lb * BLOCK, BLOCK, target.name,
                                             r["blocks"] + rb * BLOCK) for lb, rb in pairs]).wait(timeout_s=WAIT_S)
            written = pattern(31, size)
            for lb, rb in pairs:
                expected[rb * BLOCK:(rb + 1) * BLOCK] = written[lb * BLOCK:(lb + 1) * BLOCK]
            host.view()[:SIZE] = pattern(32, SIZE)
            move(engine, TransferOp.WRITE, host.address, target.name, r["vmm"], SIZE)
            assert target.ask("digest blocks")["sha"] == sha(bytes(expected))
            assert target.ask("digest vmm")["sha"] == sha(pattern(32, SIZE))
            source = bytes(expected)
    finally:
        for engine in engines:
            engine.close()
        target.close()


def peer_exit() -> None:
    """A target that dies: requests to its GPU memory fail as PeerUnavailable, nothing hangs."""
    from tidekv.errors import PeerUnavailableError

    cuda = DeviceMemory()
    target = Target()
    engine = TransferEngine()
    try:
        local = cuda.alloc(SIZE)
        engine.register((local, SIZE), location="cuda:0")
        move(engine, TransferOp.READ, local, target.name, target.regions["ipc"], SIZE)
        target.proc.kill()
        target.proc.wait(timeout=10)
        expect((PeerUnavailableError, TransferError),  # type: ignore[arg-type]
               lambda: move(engine, TransferOp.READ, local, target.name, target.regions["ipc"], SIZE))
    finally:
        engine.close()


# -- torch on a real GPU ---------------------------------------------------------------------


def serve_torch() -> None:
    """Target process holding torch CUDA tensors (run with PYTORCH_CUDA_ALLOC_CONF to pick the allocator)."""
    import torch

    engine = TransferEngine()
    generator = torch.Generator(device="cuda").manual_seed(7)
    tensors = {"big": torch.randint(0, 256, (8 * SIZE,), dtype=torch.uint8, device="cuda", generator=generator),
               "small": torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda", generator=generator)}
    torch.cuda.synchronize()
    regions = {}
    for name, t in tensors.items():
        region = engine.register(t)
        assert region.location == "cuda:0", region
        regions[name] = region.address
    print(json.dumps({"name": engine.name, "regions": regions,
                      "sha": {n: sha(t.cpu().numpy().tobytes()) for n, t in tensors.items()},
                      "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "digest":
            torch.cuda.synchronize()
            print(json.dumps({"sha": sha(tensors[arg].cpu().numpy().tobytes())}), flush=True)
        elif command == "quit":
            break
    engine.close()


def torch_tensors() -> None:
    """torch CUDA tensors: location from the tensor, DLPack, and IPC with cudaMalloc'd and
    expandable-segments (VMM) memory in the target, over cuda and over staged tcp."""
    import torch

    engine = TransferEngine()
    tcp = TransferEngine(config=TransferConfig(transport=TransportKind.TCP))
    try:
        local = torch.zeros(8 * SIZE, dtype=torch.uint8, device="cuda")
        region = engine.register(local)
        assert region.location == "cuda:0" and region.length == 8 * SIZE
        expect(ConfigError, lambda: engine.register(torch.zeros(4, 4, device="cuda").t()), "contiguous")

        class DLPackOnly:  # what a DLPack producer without data_ptr/__cuda_array_interface__ offers
            def __init__(self, t: torch.Tensor) -> None:
                self._t = t

            def __dlpack__(self, **kwargs: Any) -> Any:
                return self._t.__dlpack__(**kwargs)

            def __dlpack_device__(self) -> tuple[int, int]:
                return self._t.__dlpack_device__()

        other = torch.zeros(SIZE, dtype=torch.float16, device="cuda")
        got = engine.register(DLPackOnly(other))
        assert (got.address, got.length, got.location) == (other.data_ptr(), 2 * SIZE, "cuda:0"), got
        tcp_local = torch.zeros(8 * SIZE, dtype=torch.uint8, device="cuda")
        tcp.register(tcp_local)
        for conf in ("", "expandable_segments:True"):
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            target = Target(["serve_torch"], env)
            try:
                assert target.hello["conf"] == conf
                for e, buf in ((engine, local), (tcp, tcp_local)):
                    for name, size in (("big", 8 * SIZE), ("small", SIZE)):
                        move(e, TransferOp.READ, buf.data_ptr(), target.name, target.regions[name], size)
                        torch.cuda.synchronize()
                        # Against the target's bytes now: the first engine's WRITE below changed "small".
                        assert sha(buf[:size].cpu().numpy().tobytes()) == target.ask(f"digest {name}")["sha"], \
                            (conf, e.name, name)
                    buf.fill_(3)
                    torch.cuda.synchronize()
                    move(e, TransferOp.WRITE, buf.data_ptr(), target.name, target.regions["small"], SIZE)
                    assert target.ask("digest small")["sha"] == sha(bytes([3]) * SIZE), (conf, e.name)
                assert engine.stats()["cuda_bytes"] > 0 and tcp.stats()["cuda_bytes"] == 0
            finally:
                target.close()
    finally:
        engine.close()
        tcp.close()


SCENARIOS: dict[str, Callable[[], None]] = {f.__name__: f for f in (
    registration, in_process, forced, serve, two_process, scattered_blocks, staged, peer_exit, serve_torch,
    torch_tensors)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
