"""Bugs the fuzz harnesses (``harnesses``) found, each as a test through the real entry point.

Each is a plain regression test now that it is fixed; a bug found and not fixed yet would be a
strict xfail naming it, with its crash signature in ``harnesses.KNOWN_BUGS`` so that fuzz runs
report it apart from new ones.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest
from tidekv import auth, channel
from tidekv.auth import ClientHandshake, ServerHandshake
from tidekv.errors import AuthenticationError

from tests.fuzz.harnesses import SECRET, _read_until_closed, _Recorder, _split_frames
from tests.store.wire import authenticate, recv_frame

pytestmark = pytest.mark.timeout(60)


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _forged(sock: socket.socket, spec: channel.Spec) -> None:
    """Greets as a peer without the secret would (anyone may), then proves nothing: a made-up MAC."""
    sock.sendall(spec.magic + channel.frame(ClientHandshake(None, spec.label, "attacker").greeting()))
    challenge = auth.decode(recv_frame(sock), auth.Challenge, "server")
    assert isinstance(challenge, auth.Challenge) and challenge.mac  # a secured server
    sock.sendall(channel.frame(auth.encode(auth.Proof(bytes(32)))))


def _assert_refused_and_closed(sock: socket.socket) -> None:
    """What the server wrote until it closed: one ``auth`` refusal, nothing answered."""
    with contextlib.suppress(OSError):  # reset already
        sock.shutdown(socket.SHUT_WR)
    out, is_reset = _read_until_closed(sock, 5.0, "the server")
    replies = [(r.request_id, r.error_kind) for r in map(channel.decode_reply, _split_frames(out, is_reset))]
    assert replies == [(0, "auth")] or (is_reset and not replies), replies  # (a reset may lose the refusal)


def test_handshake_messages_with_hostile_values_are_refused_by_name() -> None:
    """The stream handshake's counterpart of the sealed message with seq -1 (an OverflowError once,
    found by auth_messages): hostile integers and sizes in any handshake message come out as
    AuthenticationError, nothing else."""
    nonce = bytes(auth.NONCE_BYTES)
    for greeting in (auth.Greeting(-1, nonce), auth.Greeting(2**64 - 1, nonce), auth.Greeting(auth.AUTH_VERSION, b"n"),
                     auth.Greeting(auth.AUTH_VERSION, nonce, "tenant")):
        with pytest.raises(AuthenticationError):
            ServerHandshake(SECRET, "pd", "fuzz").greeted(auth.encode(greeting))
    for mac in (b"", bytes(31), bytes(32), bytes(4096)):
        server = ServerHandshake(SECRET, "pd", "fuzz")
        server.greeted(ClientHandshake(SECRET, "pd", "fuzz").greeting())
        with pytest.raises(AuthenticationError):
            server.proved(auth.encode(auth.Proof(mac)))
    for challenge in (auth.Challenge(b"", bytes(32)), auth.Challenge(nonce * 2, b""), auth.Challenge(nonce, bytes(32))):
        with pytest.raises(AuthenticationError):
            ClientHandshake(SECRET, "pd", "fuzz").challenged(auth.encode(challenge))


def test_weights_publisher_keeps_serving_after_a_forged_proof() -> None:
    """An attacker without the secret greets (allowed), sends a made-up Proof and requests after it
    (a real one, one of another version, one with a negative id): the publisher answers nothing
    but the refusal, closes, and keeps serving a real subscriber."""
    import torch
    from tidekv.config import TransferConfig
    from tidekv.transfer import TransferEngine
    from tidekv.weights import protocol as p
    from tidekv.weights.publisher import Publisher

    engine = TransferEngine(config=TransferConfig(secret=SECRET))
    pub = Publisher({"w": torch.zeros(4)}, engine=engine)
    pub.publish(1)
    sock = _connect(pub.address)
    client = channel.Client(pub.address, p.SPEC, 5.0, secret=SECRET)
    try:
        _forged(sock, p.SPEC)
        with contextlib.suppress(OSError):  # closed already
            for envelope in (channel.Envelope(p.PROTOCOL_VERSION, 1, p.Versions()),
                             channel.Envelope(p.PROTOCOL_VERSION + 1, 2, p.Describe(None)),
                             channel.Envelope(p.PROTOCOL_VERSION, -1, p.Describe(1))):
                sock.sendall(channel.frame(channel.encode(envelope)))
        _assert_refused_and_closed(sock)
        assert client.call(p.Versions()) == [1]  # still there for everyone else
    finally:
        sock.close()
        client.close()
        pub.close()
        engine.close()


def test_hold_table_takes_no_release_from_a_forged_or_replayed_proof() -> None:
    """A release after a made-up Proof, or after a real client's greeting and Proof replayed on a
    new connection (the stream's counterpart of a replayed sealed message: the server's fresh
    nonce makes the old proof worthless), never frees the blocks; afterwards a real release
    still frees them before their deadline."""
    from tidekv.kvcache import handoff
    from tidekv.kvcache.handoff import HoldTable, Releaser

    table = HoldTable("127.0.0.1", hold_timeout_s=30.0, secret=SECRET)
    releaser = Releaser(SECRET)
    release = channel.frame(channel.encode(channel.Envelope(handoff.PROTOCOL_VERSION, 0, handoff.HoldRelease(
        "req-1", handoff.ReleaseReason.PULLED))))
    try:
        table.hold("req-1")
        forged = _connect(table.address)
        try:
            _forged(forged, handoff.SPEC)
            with contextlib.suppress(OSError):
                forged.sendall(release)
            _assert_refused_and_closed(forged)
        finally:
            forged.close()
        genuine, replayed = _connect(table.address), _connect(table.address)
        try:
            recorded = _Recorder(genuine)
            authenticate(recorded, SECRET, handoff.MAGIC, "pd")  # type: ignore[arg-type]
            replayed.sendall(bytes(recorded.sent))
            recv_frame(replayed)  # its own Challenge (a fresh nonce)
            with contextlib.suppress(OSError):  # closed already
                replayed.sendall(release)
            _assert_refused_and_closed(replayed)
        finally:
            genuine.close()
            replayed.close()
        assert table.released() == set() and table.is_held("req-1"), "a release without a proof freed the blocks"
        releaser.release(table.address, "req-1")
        deadline = time.monotonic() + 10
        while "req-1" not in (released := table.released()) and time.monotonic() < deadline:
            table.wait(0.2)
        assert "req-1" in released, "the hold table stopped receiving releases"
    finally:
        releaser.close()
        table.close()


def test_contract_refuses_a_key_with_a_lone_surrogate_by_name() -> None:
    """Found by proxy_request (the prefill's kv_transfer_params, as JSON may carry them)."""
    from tidekv.errors import ConfigError
    from tidekv.kvcache import contract

    from tests.fuzz.harnesses import _handoff_params

    params = json.loads(json.dumps(_handoff_params())[:-1] + ', "\\ud800": 1}')
    with pytest.raises(ConfigError):
        contract.from_params(params)


# ---- fixed ----------------------------------------------------------------------------------


def test_proxy_prefix_policy_takes_a_prompt_with_lone_surrogates() -> None:
    """Found by proxy_request: json.loads turns "\\ud800" into a lone surrogate, which plain
    UTF-8 encoding refuses: the prefix policy raised UnicodeEncodeError (an HTTP 500)."""
    from tidekv.proxy.routing import ProxyConfig, Router, RoutingPolicy

    router = Router(ProxyConfig(prefill_urls=("http://127.0.0.1:1", "http://127.0.0.1:2"),
                                decode_urls=("http://127.0.0.1:3",), policy=RoutingPolicy.PREFIX, prefix_chunk_chars=4))
    body = json.loads('{"prompt": "ab\\ud800cdefgh"}')
    first = router.pick_prefill(body)
    assert router.pick_prefill(body) == first  # the same prefix goes where it went


def test_proxy_prefix_policy_takes_any_content_part_text() -> None:
    """Found by proxy_request: a chat content part whose "text" is not a string raised TypeError
    in the prefix policy (an HTTP 500); such parts now carry no prompt text."""
    from tidekv.proxy.routing import ProxyConfig, Router, RoutingPolicy, prompt_text

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}, {"type": "text", "text": "hi"}]}]}
    assert prompt_text(body) == "hi\x1e"
    router = Router(ProxyConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",),
                                policy=RoutingPolicy.PREFIX))
    assert router.pick_prefill(body) == "http://127.0.0.1:1"


def test_proxy_refuses_json_nested_too_deep_as_a_bad_request() -> None:
    """Found reading the parser for the proxy_request harness: a body of 100k nested arrays made
    json.loads raise RecursionError, which is not a ValueError (an HTTP 500 and a traceback);
    it is now a 400 like any other unreadable body. A backend's error body likewise."""
    from tidekv.proxy import server
    from tidekv.proxy.routing import ProxyError

    from tests.fuzz.harnesses import _Request

    deep = b"[" * 100_000
    coro = server._client_json(_Request(deep))
    with pytest.raises(ProxyError) as refused:
        coro.send(None)
    assert refused.value.status == 400 and "not valid JSON" in str(refused.value)
    assert server._error_detail(deep) == deep[:500].decode()
