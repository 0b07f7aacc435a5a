"""Fuzz harnesses for every parser of bytes from the network (issue 17, item 4), one class each.

A harness takes one input (``one(data)``: any bytes) and drives it into a real parser: the
master's connection (framing, magic, the auth handshake, then requests), the auth messages
themselves, the weights publisher's control messages, the PD hold table's releases, the PD
contract, the proxy's request parsing; ``engine_harnesses`` holds the two that go through the
native module into a live transfer engine. ``one`` raises when a property breaks (an exception
the parser must not raise, a reply nobody can decode, a release that was not sealed).

Inputs are read through ``fuzzing.Source`` (a plain byte reader), so the same harness runs under
atheris (``benchmarks/fuzz.py``: coverage-guided, hours) and under pytest (``test_harnesses``:
seeds and random mutations, seconds), without atheris installed. ``HARNESSES`` names them all.

Neighbours: ``fuzzing`` (the kit), ``test_parsers`` (hypothesis properties of the master's
messages and the descriptor decoder).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import msgspec
from tidekv import auth
from tidekv.auth import ClientHandshake, ServerHandshake
from tidekv.errors import AuthenticationError, ConfigError, ProtocolVersionError

from tests.fuzz.engine_harnesses import EngineFrames, EngineHandshake
from tests.fuzz.fuzzing import (  # noqa: F401 - the kit, re-exported for the driver and the tests
    KNOWN_BUGS,
    SECRET,
    Hang,
    Harness,
    Source,
    Tally,
    mutations,
    run_one,
    signature,
)

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
    """Bytes into a master connection (``store.connection.MasterConnection``), as the event loop delivers
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
        from tidekv.store.connection import MasterConnection

        src = Source(data)
        flags = src.byte()
        secret = SECRET if flags & 1 else None
        mode = (flags >> 1) % 4
        self.note(("raw", "after the magic", "after a greeting", "after a whole handshake")[mode] + (", secured" if secret else ""))
        server = self._servers[secret]
        transport = _FakeTransport()
        conn = MasterConnection(server)
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
        self.note(("greeted", "proved", "challenged", "decoded", "made-up sealed", "altered sealed")[mode]
                  + (", secured" if secret and mode < 4 else ""))
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
        self.note(("raw", "sealed by a live session", "made up, with a live session id")[mode] + ", secured" if secret
                  else "raw" if mode == 0 else "plain, after a greeting")
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
        self.note(("raw", "sealed by a live session", "made up, with a live session id")[mode] + ", secured" if secret
                  else "raw" if mode == 0 else "plain, after a greeting")
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
        self.note(("any JSON", "real params, one field replaced", "real params, protocol_version replaced")[mode])
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

        self.note("raw body" if data[:1] == b"{" else "real request, one value replaced")
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


HARNESSES: dict[str, type[Harness]] = {h.name: h for h in (
    MasterFrames, AuthMessages, WeightsControl, PdRelease, PdContract, ProxyRequest, EngineHandshake, EngineFrames)}
