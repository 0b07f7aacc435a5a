"""Fuzz harnesses for every parser of bytes from the network (issue 17, item 4), one class each.

A harness takes one input (``one(data)``: any bytes) and drives it into a real parser: the
master's connection (framing, magic, the auth handshake, then requests), the auth messages
themselves, the weights publisher's control messages, the PD hold table's releases, the PD
contract, the proxy's request parsing, and -- through the native module, on loopback -- the
transfer engine's handshake and its data frames. ``one`` raises when a property breaks (an
exception the parser must not raise, a reply nobody can decode, a release that was not sealed,
a write outside the registered region); ``run_one`` turns that into a crash *signature* (the
exception type and the innermost tidekv function it came from) so that a long run keeps going
and reports every distinct one. A crash of the process itself (the native engine) ends the run.

Inputs are read through ``Source`` (a plain byte reader), so the same harness runs under
atheris (``benchmarks/fuzz.py``: coverage-guided, hours) and under pytest (``test_harnesses``:
seeds and random mutations, seconds), without atheris installed. ``KNOWN_BUGS`` lists the
signatures of bugs found here and not fixed yet (each has an ``xfail(strict=True)`` test in
``test_known_bugs``): a run reports them apart from new ones.

Neighbours: ``tests/transfer/rawwire`` (the transfer wire), ``test_parsers`` (hypothesis
properties of the master's messages and the descriptor decoder).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from tidekv import auth
from tidekv.auth import ClientHandshake, ServerHandshake
from tidekv.errors import AuthenticationError, ConfigError, ProtocolVersionError

from tests.transfer import rawwire

SECRET = "fuzz-secret"

KNOWN_BUGS: dict[str, str] = {}
"""Crash signatures of bugs found and not fixed yet (none now: the negative-seq OverflowError in
tidekv.auth and the lone-surrogate UnicodeEncodeError in contract.from_params are fixed, with
regression tests in test_found)."""


class Hang(Exception):
    """A peer neither answered nor closed within the harness's deadline."""


class Source:
    """Reads typed values off the front of an input; past its end every read gives zeros/empty."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size).ljust(size, b"\0"), "little")

    def take(self, size: int) -> bytes:
        out = self.data[self.at: self.at + size]
        self.at += len(out)
        return out

    def rest(self) -> bytes:
        out = self.data[self.at:]
        self.at = len(self.data)
        return out

    def wide_int(self) -> int:
        """Any msgpack integer: -2**63 .. 2**64-1, small ones likelier."""
        kind = self.byte() % 4
        if kind == 0:
            return self.byte() - 128
        if kind == 1:
            return self.uint(8) - (1 << 63)
        if kind == 2:
            return self.uint(8)
        return -self.uint(2)


@dataclass
class Tally:
    inputs: int = 0
    crashes: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # signature -> first input (hex) and traceback
    hangs: int = 0

    def new_crashes(self) -> dict[str, int]:
        return {s: n for s, n in self.crashes.items() if s not in KNOWN_BUGS}

    def as_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "crashes": self.crashes, "hangs": self.hangs, "examples": self.examples}


def signature(exc: BaseException) -> str:
    """``Type@file:function`` of the innermost frame in tidekv (else in the harness)."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in frames if "/core/" in f.filename or "/tidekv/" in f.filename] or frames
    where = f"{os.path.basename(inner[-1].filename)}:{inner[-1].name}" if inner else "?"
    return f"{type(exc).__name__}@{where}"


def run_one(harness: Harness, tally: Tally, data: bytes) -> None:
    """One input; an exception becomes a crash (or a hang) in the tally, never propagates."""
    tally.inputs += 1
    try:
        harness.one(data)
    except Hang as exc:
        tally.hangs += 1
        tally.examples.setdefault("hang", f"{data.hex()}\n{exc}")
    except Exception as exc:  # noqa: BLE001 - every escape is what the run reports
        sig = signature(exc)
        tally.crashes[sig] = tally.crashes.get(sig, 0) + 1
        if sig not in tally.examples:
            tally.examples[sig] = f"{data[:4096].hex()}\n{''.join(traceback.format_exception(exc))[-3000:]}"


def mutations(seeds: list[bytes], count: int, seed: int = 0) -> Iterator[bytes]:
    """``count`` inputs: the seeds, then random mutations of them (flips, cuts, splices, random
    bytes) -- the pytest run's stand-in for atheris."""
    rng = random.Random(seed)
    yield from seeds[:count]
    for _ in range(count - len(seeds)):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 5)):
            kind = rng.randrange(6)
            at = rng.randrange(len(data) + 1)
            if kind == 0 and data:
                data[min(at, len(data) - 1)] = rng.randrange(256)
            elif kind == 1:
                data[at:at] = rng.randbytes(rng.randrange(1, 16))
            elif kind == 2:
                del data[at: at + rng.randrange(1, 16)]
            elif kind == 3:
                data = data[:at]
            elif kind == 4:
                other = rng.choice(seeds)
                data[at:] = other[rng.randrange(len(other) + 1):]
            else:
                data = bytearray(data[:1] + rng.randbytes(rng.randrange(64)))
        yield bytes(data)


class Harness:
    name: ClassVar[str]
    is_native: ClassVar[bool] = False

    def setup(self) -> None:
        """Builds the servers the inputs go to (once per run)."""

    def one(self, data: bytes) -> None:
        raise NotImplementedError

    def seeds(self) -> list[bytes]:
        """Starting inputs (real messages) for the random mutator and atheris's corpus."""
        return [b""]

    def report(self) -> dict[str, Any]:
        """Harness-specific results (the native ones: stray writes)."""
        return {}

    def close(self) -> None:
        pass


# ---- the master's connection: magic, auth handshake, framing, requests -----------------------


class _FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        if not self.closed:
            self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _frames(data: bytes) -> list[bytes]:
    from tidekv.store import protocol as p

    out, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at: at + p.FRAME_HEADER], "little")
        assert at + p.FRAME_HEADER + size <= len(data), "the master wrote a torn frame"
        out.append(data[at + p.FRAME_HEADER: at + p.FRAME_HEADER + size])
        at += p.FRAME_HEADER + size
    return out


class MasterFrames(Harness):
    """Bytes into a master connection (``store.server._Connection``), as the event loop delivers
    them, in chunks: raw; after the magic; after a real greeting; after a whole (right-secret)
    handshake. Every byte the master writes back must be whole frames: the Challenge, then
    replies a client decodes; on a secured master nothing but ``auth`` errors unless the
    handshake was completed; the buffered-bytes books return to zero when the connection ends."""

    name = "master_frames"
    _REBUILD_EVERY = 5000

    def setup(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._count = 0
        self._build()

    def _build(self) -> None:
        from tidekv.config import MasterConfig
        from tidekv.store.server import MasterServer

        self._servers = {s: MasterServer(MasterConfig(port=0, metrics_port=-1, busy_poll_us=0, max_batch_keys=1000,
                                                      secret=s)) for s in (None, SECRET)}

    def one(self, data: bytes) -> None:
        self._count += 1
        if self._count % self._REBUILD_EVERY == 0:
            self._build()  # the fuzzed mounts and puts pile up in the service otherwise
        self._loop.run_until_complete(self._one(data))

    async def _one(self, data: bytes) -> None:
        from tidekv.store import protocol as p
        from tidekv.store.server import _Connection

        src = Source(data)
        flags = src.byte()
        secret = SECRET if flags & 1 else None
        mode = (flags >> 1) % 4
        server = self._servers[secret]
        transport = _FakeTransport()
        conn = _Connection(server)
        conn.connection_made(transport)
        is_authenticated = False
        if mode >= 1:
            self._feed(conn, transport, p.MAGIC)
        if mode >= 2:
            client = ClientHandshake(secret if mode == 3 else None, "master", "fuzz")
            self._feed(conn, transport, p.frame(client.greeting()))
            if mode == 3:
                challenge = _frames(bytes(transport.out))[0]
                self._feed(conn, transport, p.frame(client.challenged(challenge)))
                is_authenticated = True
        while src.at < len(data) and not transport.closed:
            self._feed(conn, transport, src.take(1 + src.byte() * 64))
        conn.connection_lost(None)
        assert server._buffered == 0 and conn not in server._partial, "buffered-bytes books not back to zero"
        frames = _frames(bytes(transport.out))
        if frames and isinstance(auth.decode_any(frames[0]), auth.Challenge):
            frames.pop(0)  # the answer to a greeting (ours, or one the input made)
        elif mode >= 2:
            raise AssertionError(f"the master answered a greeting with {frames[:1]!r}, not a Challenge")
        for raw in frames:
            reply = p.decode_reply(raw)
            if secret is not None and not is_authenticated:
                assert reply.error_kind == p.ErrorKind.AUTH, f"a secured master answered {reply} before a proof"
            assert reply.error_kind != "internal", reply.error

    @staticmethod
    def _feed(conn: Any, transport: _FakeTransport, chunk: bytes) -> None:
        if transport.closed or not chunk:
            return
        conn._read[: len(chunk)] = chunk
        conn.buffer_updated(len(chunk))

    def seeds(self) -> list[bytes]:
        from tidekv.store import protocol as p

        hello = p.frame(p.encode(p.Envelope(p.PROTOCOL_VERSION, 1, p.Hello("c", 1))))
        get = p.frame(p.encode(p.Envelope(p.PROTOCOL_VERSION, 2, p.Get([b"k"]))))
        return [b"\x06" + b"\x10" + hello + b"\x08" + get, b"\x07" + hello, b"\x00" + p.MAGIC, b"\x04" + get]


# ---- the auth messages ----------------------------------------------------------------------


class AuthMessages(Harness):
    """``tidekv.auth`` fed anything a peer could send: only AuthenticationError may come out,
    a forged or altered sealed message never opens, a secured side never accepts a proof."""

    name = "auth_messages"

    def one(self, data: bytes) -> None:
        src = Source(data)
        flags = src.byte()
        secret = SECRET if flags & 1 else None
        mode = (flags >> 1) % 6
        try:
            if mode == 0:
                challenge = ServerHandshake(secret, "master", "fuzz").greeted(src.rest())
                auth.decode(challenge, auth.Challenge, "fuzz")
            elif mode == 1:
                server = ServerHandshake(secret, "master", "fuzz")
                server.greeted(ClientHandshake(secret, "master", "fuzz").greeting())
                server.proved(src.rest())
                assert secret is None, "a secured server accepted a proof it never saw made"
            elif mode == 2:
                ClientHandshake(secret, "master", "fuzz").challenged(src.rest())
                assert secret is None, "a client with a secret accepted a challenge nobody proved"
            elif mode == 3:
                auth.decode_any(src.rest())
                auth.decode(data[1:], (auth.Greeting, auth.Challenge, auth.Proof, auth.Sealed)[flags % 4], "fuzz")
            else:
                self._sealed(src, mode == 5)
        except AuthenticationError:
            pass

    @staticmethod
    def _sealed(src: Source, is_mutated: bool) -> None:
        client = ClientHandshake(SECRET, "pd", "fuzz")
        server = ServerHandshake(SECRET, "pd", "fuzz")
        client.challenged(server.greeted(client.greeting()))
        assert client.sealer is not None
        opener = auth.Sealer(server.session_key(), server.nonce, "fuzz")
        if is_mutated:  # a real sealed message, one field changed
            real = auth.decode(client.sealer.seal(src.take(src.byte())), auth.Sealed, "fuzz")
            assert isinstance(real, auth.Sealed)
            which = src.byte() % 4
            forged = msgspec.structs.replace(real, **{
                0: {"session": src.take(32)}, 1: {"seq": src.wide_int()},
                2: {"mac": src.take(32)}, 3: {"body": src.rest()}}[which])
            if forged.seq == real.seq and forged.mac == real.mac and forged.body == real.body:
                return  # unchanged where the MAC looks (the session picks the sealer, not the MAC)
            opener.open(forged)
            raise AssertionError(f"an altered sealed message opened: {forged}")
        sealed = auth.Sealed(src.take(32), src.wide_int(), src.take(32), src.rest())
        opener.open(auth.decode(auth.encode(sealed), auth.Sealed, "fuzz"))  # type: ignore[arg-type]
        raise AssertionError("a sealed message with a made-up MAC opened")

    def seeds(self) -> list[bytes]:
        greeting = ClientHandshake(SECRET, "x", "y").greeting()
        return [b"\x00" + greeting, b"\x01" + greeting, b"\x08\x05\x01" + os.urandom(40), b"\x0a\x10" + b"a" * 16]


# ---- the weights publisher's control socket -------------------------------------------------


class WeightsControl(Harness):
    """``Publisher._answer`` (the control socket's one entry point) fed any message: raw bytes,
    sealed bodies of a live session, made-up sealed messages. It must return a reply the
    subscriber decodes (a Challenge, a sealed reply, or a plain reply), never raise."""

    name = "weights_control"
    _REBUILD_EVERY = 20000

    def setup(self) -> None:
        self._count = 0
        self._pubs: dict[str | None, Any] = {}
        self._build()

    def _build(self) -> None:
        import torch
        from tidekv.config import TransferConfig
        from tidekv.transfer import TransferEngine
        from tidekv.weights.publisher import Publisher

        self.close()
        for secret in (None, SECRET):
            engine = TransferEngine(config=TransferConfig(secret=secret))
            pub = Publisher({"w": torch.arange(64, dtype=torch.float32)}, engine=engine)
            pub.publish(1)
            self._pubs[secret] = (pub, engine)

    def close(self) -> None:
        for pub, engine in self._pubs.values():
            pub.close()
            engine.close()
        self._pubs = {}

    def one(self, data: bytes) -> None:
        from tidekv.weights import protocol as p

        self._count += 1
        if self._count % self._REBUILD_EVERY == 0:
            self._build()
        src = Source(data)
        flags = src.byte()
        secret = SECRET if flags & 1 else None
        mode = (flags >> 1) % 3
        pub = self._pubs[secret][0]
        if mode == 0:
            answer = pub._answer(src.rest())
            if isinstance(auth.decode_any(answer), auth.Challenge):
                return
            p.reply_decoder.decode(answer)
            return
        client = ClientHandshake(secret, "weights", "fuzz")
        client.challenged(pub._answer(client.greeting()))
        if secret is None:
            p.reply_decoder.decode(pub._answer(src.rest()))
            return
        assert client.sealer is not None
        if mode == 1:
            answer = pub._answer(client.sealer.seal(src.rest()))
            sealed = auth.decode(answer, auth.Sealed, "publisher")
            assert isinstance(sealed, auth.Sealed)
            p.reply_decoder.decode(client.sealer.open(sealed, is_reply=True))
            return
        made_up = auth.Sealed(client.sealer.session, src.wide_int(), src.take(32), src.rest())
        reply = p.reply_decoder.decode(pub._answer(auth.encode(made_up)))
        assert isinstance(reply, p.Error) and reply.kind.startswith("auth"), f"a made-up sealed request got {reply}"

    def seeds(self) -> list[bytes]:
        from tidekv.weights import protocol as p

        describe = p.encoder.encode(p.Describe(p.PROTOCOL_VERSION, None))
        return [b"\x00" + describe, b"\x03" + describe, b"\x02" + describe, b"\x05\x01" + b"m" * 32]


# ---- the PD hold channel --------------------------------------------------------------------


class PdRelease(Harness):
    """``HoldTable._receive`` fed any message: no exception; on a secured table nothing is
    released that a live session did not seal; a release that is recorded is exactly the
    ``HoldRelease`` its (sealed or, without a secret, plain) body decodes to."""

    name = "pd_release"

    def setup(self) -> None:
        from tidekv.kvcache.handoff import HoldTable

        self._tables = {s: HoldTable("127.0.0.1", 600.0, s) for s in (None, SECRET)}

    def close(self) -> None:
        for t in self._tables.values():
            t.close()

    def one(self, data: bytes) -> None:
        from tidekv.kvcache import handoff

        src = Source(data)
        flags = src.byte()
        secret = SECRET if flags & 1 else None
        mode = (flags >> 1) % 3
        table = self._tables[secret]
        body: bytes | None = None  # the body whose release may be recorded
        try:
            if mode == 0:
                body = src.rest()
                answer = table._receive(body)
                if secret is not None:
                    body = None
                if answer is not None:
                    auth.decode(answer, auth.Challenge, "hold table")
                    body = None
                return
            client = ClientHandshake(secret, "pd", "fuzz")
            client.challenged(table._receive(client.greeting()))
            if secret is None:
                body = src.rest()
                assert table._receive(body) is None
                return
            assert client.sealer is not None
            if mode == 1:
                body = src.rest()
                assert table._receive(client.sealer.seal(body)) is None
                return
            made_up = auth.Sealed(client.sealer.session, src.wide_int(), src.take(32), src.rest())
            assert table._receive(auth.encode(made_up)) is None
        finally:
            with table._cond:
                recorded = [r for _, r in table._releases.values()]
                table._releases.clear()
            if recorded:
                assert body is not None, f"released {recorded} from a message nobody sealed"
                expected = handoff._decode(body)
                assert recorded == [expected] and expected.protocol_version == handoff.PROTOCOL_VERSION, recorded

    def seeds(self) -> list[bytes]:
        from tidekv.kvcache import handoff

        release = handoff._encode(handoff.HoldRelease(handoff.PROTOCOL_VERSION, "req-1", handoff.ReleaseReason.PULLED))
        return [b"\x00" + release, b"\x01" + release, b"\x03" + release, b"\x05\x01" + b"m" * 32]


# ---- the PD contract ------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON a peer sends (and NaN breaks the round-trip check)")


def _handoff_params() -> dict[str, Any]:
    from tidekv.kvcache import contract

    rank = contract.RankEndpoint("127.0.0.1:1", {"layers": []}, "127.0.0.1:2")
    return contract.to_params(contract.KVHandoff(request_id="r", engine_id="e", block_ids=[1, 2], num_tokens=30,
                                                 block_size=16, tp_size=1, ranks=[rank]))


class PdContract(Harness):
    """``contract.from_params`` fed any JSON (as ``kv_transfer_params`` arrive), and real params
    with one field replaced: ProtocolVersionError or ConfigError only; what it accepts survives a
    round trip through ``to_params``."""

    name = "pd_contract"

    def one(self, data: bytes) -> None:
        from tidekv.kvcache import contract

        src = Source(data)
        mode, which = src.byte() % 3, src.byte()
        try:
            value = json.loads(src.rest(), parse_constant=_no_constant)
        except (ValueError, RecursionError):  # the engine's JSON parser, not the contract, refuses those
            return
        if mode == 0:
            if not isinstance(value, dict):
                return
            params = value
        else:
            params = _handoff_params()
            names = sorted(params) + ["ranks.0", "ranks.0.engine", "ranks.0.layout", "ranks.0.confirm_address"]
            name = names[which % len(names)] if mode == 1 else "protocol_version"
            if name == "ranks.0":
                params["ranks"] = [value]
            elif name.startswith("ranks.0."):
                params["ranks"] = [dict(params["ranks"][0], **{name[len("ranks.0."):]: value})]
            else:
                params[name] = value
        try:
            handoff = contract.from_params(params)
        except (ProtocolVersionError, ConfigError):
            return
        assert contract.from_params(contract.to_params(handoff)) == handoff

    def seeds(self) -> list[bytes]:
        params = json.dumps(_handoff_params()).encode()
        return [b"\x00\x00" + params, b"\x01\x03" + b'"x"', b"\x02\x00" + b"2", b"\x01\x09" + b"[1,2]"]


# ---- the proxy's request parsing ------------------------------------------------------------


def _nodes(tree: Any) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every value inside a JSON tree."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield tree, key
        yield from _nodes(value)


class _Request:
    def __init__(self, body: bytes) -> None:
        self._body = body

    async def read(self) -> bytes:
        return self._body


class ProxyRequest(Harness):
    """A client's request body through everything the proxy does with it before (and after) the
    backends: JSON parsing (``_client_json``: a 400 ProxyError for bad bodies), routing (prefix
    and store policies), the prefill and decode requests built from it, the token ids and
    /tokenize request, the prefill's kv_transfer_params (a store card, blocks to release), and a
    backend's error body. Nothing else may come out; the requests built stay JSON."""

    name = "proxy_request"

    def setup(self) -> None:
        from tidekv.proxy.routing import ProxyConfig, Router, RoutingPolicy

        urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
        self._prefix = Router(ProxyConfig(prefill_urls=urls, decode_urls=urls[:1], policy=RoutingPolicy.PREFIX,
                                          prefix_chunk_chars=8, prefix_capacity=1024))
        self._store = Router(ProxyConfig(prefill_urls=urls, decode_urls=urls[:1], policy=RoutingPolicy.STORE,
                                         master="127.0.0.1:9"))

    def one(self, data: bytes) -> None:
        from tidekv.proxy import server
        from tidekv.proxy.routing import ProxyError, decode_request, prefill_request
        from tidekv.proxy.store_policy import prompt_token_ids, tokenize_request

        if data[:1] == b"{":
            server._error_detail(data)
        else:  # a real request with one of its values (any node of the JSON tree) replaced
            src = Source(data)
            template = json.loads(self.seeds()[src.byte() % 3])
            nodes = list(_nodes(template))
            holder, key = nodes[src.byte() % len(nodes)]
            try:
                holder[key] = json.loads(src.rest(), parse_constant=_no_constant)
            except (ValueError, RecursionError):
                return
            data = json.dumps(template).encode()
        coro = server._client_json(_Request(data))
        try:
            coro.send(None)
        except StopIteration as done:
            body = done.value
        except ProxyError as exc:
            assert exc.status == 400, exc
            return
        else:
            raise AssertionError("_client_json awaited something")
        self._prefix.pick_prefill(body)
        first = prefill_request(body)
        assert first["max_tokens"] == 1 and first["stream"] is False
        kv = body.get("kv_transfer_params")
        kv = kv if isinstance(kv, dict) else None
        second = decode_request(body, kv)
        json.dumps(first), json.dumps(second)
        tokens = prompt_token_ids(body)
        assert tokens is None or all(type(t) is int for t in tokens)
        tokenize_request(body)
        if kv is not None:
            server._held_blocks(kv)
            self._store.learn(self._store.config.prefill_urls[0], kv)

    def seeds(self) -> list[bytes]:
        return [json.dumps({"model": "m", "prompt": "hello world, again", "max_tokens": 5}).encode(),
                json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).encode(),
                json.dumps({"prompt": [[1, 2, 3]], "kv_transfer_params": _handoff_params()}).encode(), b"{}"]


# ---- the transfer engine, through the native module ------------------------------------------


def _engine(secret: str | None) -> Any:
    from tidekv.config import TransferConfig
    from tidekv.transfer import TransferEngine

    return TransferEngine(config=TransferConfig(secret=secret, io_timeout_s=5.0))


class EngineHandshake(Harness):
    """Connections to a live engine (with and without a secret) that send any bytes: before the
    Hello, after a valid Hello, after a whole handshake; and descriptors given to ``add_peer``
    (garbage and real ones mutated). The engine must close (or answer) within the deadline after
    our end hangs up, raise only typed errors from add_peer, and keep serving real peers."""

    name = "engine_handshake"
    is_native = True
    DEADLINE_S = 5.0
    _CHECK_EVERY = 2000

    def setup(self) -> None:
        self._engines = {s: _engine(s) for s in (None, SECRET)}
        self._count = 0
        self.by_mode = [0, 0, 0, 0]

    def close(self) -> None:
        for e in self._engines.values():
            e.close()

    def one(self, data: bytes) -> None:
        self._count += 1
        if self._count % self._CHECK_EVERY == 0:
            self._check_alive()
        src = Source(data)
        flags = src.byte()
        secret = SECRET if flags & 1 else None
        mode = (flags >> 1) % 4
        engine = self._engines[secret]
        self.by_mode[mode] += 1
        if mode >= 2:
            native = engine._native
            blob = src.rest() if mode == 2 else self._mutated(native.descriptor(), src)
            try:
                native.add_peer(f"127.0.0.1:{9 + flags}", blob)
            except (ConfigError, ProtocolVersionError):
                pass
            return
        sock = rawwire.connect(engine.name)
        try:
            if mode == 1:
                nonce = os.urandom(32)
                sock.sendall(rawwire.pack_hello(nonce, conn_type=1 + src.byte() % 2))
            try:
                sock.sendall(src.rest())
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                return  # the engine hung up first (a bad Hello): what we want
            if not rawwire.is_closed_by_peer(sock, self.DEADLINE_S):
                raise Hang(f"engine {engine.name} kept a connection open {self.DEADLINE_S} s after it hung up")
        finally:
            sock.close()

    @staticmethod
    def _mutated(real: bytes, src: Source) -> bytes:
        out = bytearray(real)
        for _ in range(1 + src.byte() % 8):
            out[src.uint(2) % len(out)] = src.byte()
        return bytes(out[: src.uint(2) % (len(out) + 1)])

    def _check_alive(self) -> None:
        for secret, engine in self._engines.items():
            sock, status = rawwire.handshake(engine.name, secret)
            sock.close()
            assert status == rawwire.STATUS_OK, f"engine {engine.name} stopped accepting real peers ({status})"

    def report(self) -> dict[str, Any]:
        self._check_alive()
        return {"inputs_by_kind": dict(zip(("raw connection", "after a Hello", "add_peer garbage", "add_peer mutated"),
                                           self.by_mode)),
                "engine_stats": {"secret" if s else "open": e.stats() for s, e in self._engines.items()}}

    def seeds(self) -> list[bytes]:
        return [b"\x00" + rawwire.pack_hello(b"n" * 32), b"\x02" + b"\x00" * 8 + os.urandom(64), b"\x04\x03\x01",
                b"\x06\x01" + b"\x00" * 40]


@dataclass(frozen=True)
class _Frame:
    op: int
    addr: int
    length: int
    span_addr: int
    span_length: int
    payload: bytes


GUARD_BYTES = 4096
REGION_BYTES = 64 << 10
_GUARD_PATTERN = bytes((i * 37 + 11) & 0xFF for i in range(GUARD_BYTES))


class EngineFrames(Harness):
    """Data frames (READ/WRITE requests, as ``native/common/wire.h`` lays them out) at a live
    engine over a handshaken raw connection, aimed around one registered region that has
    ``GUARD_BYTES`` of a known pattern right before and after it (memory the engine was not
    given). After every input: the guards are intact (no write outside the registered region),
    every reply is well formed and in order, a READ that succeeds returns the region's bytes,
    and -- while the connection stands -- the region holds exactly what acknowledged WRITEs
    wrote (a Python reference copy). Refused frames must be answered or the connection closed
    within the deadline."""

    name = "engine_frames"
    is_native = True
    DEADLINE_S = 5.0

    def setup(self) -> None:
        import numpy as np

        self._engine = _engine(None)
        self._memory = np.zeros(GUARD_BYTES + REGION_BYTES + GUARD_BYTES, dtype=np.uint8)
        self._bytes = memoryview(self._memory).cast("B")
        self._bytes[:GUARD_BYTES] = _GUARD_PATTERN
        self._bytes[-GUARD_BYTES:] = _GUARD_PATTERN
        self._base = int(self._memory.ctypes.data) + GUARD_BYTES
        self._region = self._engine.register((self._base, REGION_BYTES))
        self._reference = bytearray(REGION_BYTES)
        self._sock: socket.socket | None = None
        self.stray_writes = 0
        self.frames_sent = 0
        self.reconnects = 0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._engine.close()

    def _connection(self) -> socket.socket:
        if self._sock is None:
            self._sock, status = rawwire.handshake(self._engine.name)
            self._sock.settimeout(self.DEADLINE_S)
            assert status == rawwire.STATUS_OK, status
            self.reconnects += 1
        return self._sock

    def _address(self, src: Source) -> int:
        kind = src.byte() % 8
        if kind < 6:  # around the region: from two guards before it to two after
            return self._base - 2 * GUARD_BYTES + src.uint(3) % (REGION_BYTES + 4 * GUARD_BYTES)
        return src.uint(8) if kind == 6 else self._base + REGION_BYTES - src.uint(1)

    @staticmethod
    def _length(src: Source) -> int:
        kind = src.byte() % 16
        if kind < 14:
            return src.uint(2) % 4097
        return src.uint(8) if kind == 14 else REGION_BYTES + GUARD_BYTES - src.uint(1)

    def one(self, data: bytes) -> None:
        src = Source(data)
        sent: list[_Frame] = []
        wire = bytearray()
        is_complete = True  # every frame whole, its payload all there: every reply must come
        is_malformed = False  # the last frame breaks the format: the engine must hang up
        for tag in range(1 + src.byte() % 4):
            op_byte = src.byte()
            op = op_byte % 2 if op_byte < 252 else op_byte
            addr, length = self._address(src), self._length(src)
            span_addr, span_length = addr, length
            if src.byte() % 32 == 31:  # the slice of a larger request, maybe not inside it
                span_addr, span_length = (addr - src.uint(2)) % (1 << 64), (length + src.uint(2)) % (1 << 64)
            magic = rawwire.MAGIC if src.byte() % 64 != 63 else src.uint(4)
            wire += rawwire.REQUEST.pack(magic, op, addr, length, tag, span_addr, span_length)
            is_malformed = (magic != rawwire.MAGIC or op > 1 or addr < span_addr or length > span_length
                            or addr - span_addr > span_length - length)
            if is_malformed:
                break
            payload = b""
            if op == rawwire.OP_WRITE:
                payload = src.take(min(length, 8192))
                if len(payload) < length:
                    payload += b"\xa5" * min(length - len(payload), 8192 - len(payload))
                is_complete = is_complete and len(payload) == length
                wire += payload
            sent.append(_Frame(op, addr, length, span_addr, span_length, payload))
            if not is_complete:
                break
        self.frames_sent += len(sent) + is_malformed
        sock = self._connection()
        is_intact = False
        try:
            sock.sendall(wire)
            if is_complete:
                is_intact = self._replies(sock, sent)
            if is_complete and is_malformed and not rawwire.is_closed_by_peer(sock, self.DEADLINE_S):
                raise Hang(f"engine {self._engine.name} kept a connection open {self.DEADLINE_S} s after a "
                           "malformed frame")
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, TimeoutError) and is_complete:
                self._check_guards()
                raise Hang(f"engine {self._engine.name} neither answered nor closed within {self.DEADLINE_S} s") from None
        self._check_guards()
        region = self._bytes[GUARD_BYTES: GUARD_BYTES + REGION_BYTES]
        if is_intact and not is_malformed:
            assert region == self._reference, "the region differs from what acknowledged writes wrote"
            return
        # The connection is done for (a malformed frame, or we cut a payload short): a write may
        # have landed in part, inside the region. Once the engine has let go of the connection
        # (it may still be copying what it had read), start again from what the region holds.
        sock.close()
        self._sock = None
        deadline = time.monotonic() + self.DEADLINE_S
        while self._engine.stats()["connections_open"]:
            if time.monotonic() > deadline:
                raise Hang(f"engine {self._engine.name} still serves a connection {self.DEADLINE_S} s after we closed it")
            time.sleep(0.0002)
        self._check_guards()
        self._reference[:] = region

    def _replies(self, sock: socket.socket, sent: list[_Frame]) -> bool:
        """Reads one reply per frame; True when all came (the connection stands)."""
        end = self._base + REGION_BYTES
        for tag, f in enumerate(sent):
            try:
                status, got_length, got_tag, body = rawwire.recv_response(sock)
            except ConnectionError:
                return False
            assert got_tag == tag, f"reply for frame {got_tag}, expected {tag}"
            inside = self._base <= f.span_addr and f.span_addr + f.span_length <= end
            if status == rawwire.STATUS_OK:
                assert inside, f"the engine served {f.span_length} bytes at {f.span_addr:#x}, outside the region"
                at = f.addr - self._base
                if f.op == rawwire.OP_READ:
                    assert got_length == f.length, f"READ of {f.length} bytes answered with {got_length}"
                    # A READ's reply goes out from the region itself when the engine flushes its
                    # replies, so a later WRITE of the same input to the same bytes may show in
                    # it (pipelined frames of one connection are not isolated from each other).
                    if not any(g.op == rawwire.OP_WRITE and g.addr < f.addr + f.length and f.addr < g.addr + g.length
                               for g in sent[tag + 1:]):
                        assert body == self._reference[at: at + f.length], "READ returned other bytes"
                else:
                    assert got_length == 0
                    self._reference[at: at + f.length] = f.payload
            else:
                assert status == rawwire.STATUS_NOT_REGISTERED and got_length == 0, (status, got_length)
                assert not inside or f.span_length == 0, \
                    f"the engine refused {f.span_length} bytes at {f.span_addr:#x}, inside the registered region"
        return True

    def _check_guards(self) -> None:
        before, after = self._bytes[:GUARD_BYTES], self._bytes[-GUARD_BYTES:]
        if before != _GUARD_PATTERN or after != _GUARD_PATTERN:
            self.stray_writes += 1
            self._bytes[:GUARD_BYTES] = _GUARD_PATTERN
            self._bytes[-GUARD_BYTES:] = _GUARD_PATTERN
            raise AssertionError("a guard region around the registered region was written")

    def report(self) -> dict[str, Any]:
        self._check_guards()
        return {"writes_outside_regions": self.stray_writes, "frames_sent": self.frames_sent,
                "connections": self.reconnects, "guard_bytes": GUARD_BYTES, "engine_stats": self._engine.stats()}

    def seeds(self) -> list[bytes]:
        return [b"\x00\x01" + b"\x00" * 3 + b"\x10\x00\x00" + b"\x00\x10\x00" + b"\x01\x01" + b"abcd" * 8,
                b"\x01\x00" + b"\x00" * 20, b"\x03" + os.urandom(60)]


HARNESSES: dict[str, type[Harness]] = {h.name: h for h in (
    MasterFrames, AuthMessages, WeightsControl, PdRelease, PdContract, ProxyRequest, EngineHandshake, EngineFrames)}
