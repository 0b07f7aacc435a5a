"""Bugs the fuzz harnesses (``harnesses``) found, each as a test through the real entry point.

Each is a plain regression test now that it is fixed; a bug found and not fixed yet would be a
strict xfail naming it, with its crash signature in ``harnesses.KNOWN_BUGS`` so that fuzz runs
report it apart from new ones.
"""

from __future__ import annotations

import json
import time

import pytest
import zmq
from tidekv import auth
from tidekv.auth import ClientHandshake, ServerHandshake
from tidekv.errors import AuthenticationError

from tests.fuzz.harnesses import SECRET

pytestmark = pytest.mark.timeout(60)


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    return sock


def _greet(sock: zmq.Socket, label: str, peer: str) -> bytes:
    """Greets as a peer without the secret would (anyone may): returns the session id the
    server's Challenge hands out."""
    handshake = ClientHandshake(None, label, peer)
    sock.send(handshake.greeting())
    assert sock.poll(5000), f"{peer} did not answer a greeting"
    challenge = auth.decode(sock.recv(), auth.Challenge, peer)
    assert isinstance(challenge, auth.Challenge)
    return challenge.nonce


def test_a_sealed_message_with_a_negative_seq_is_refused_by_name() -> None:
    client, server = ClientHandshake(SECRET, "pd", "fuzz"), ServerHandshake(SECRET, "pd", "fuzz")
    client.challenged(server.greeted(client.greeting()))
    opener = auth.Sealer(server.session_key(), server.nonce, "fuzz")
    with pytest.raises(AuthenticationError):
        opener.open(auth.Sealed(server.nonce, -1, bytes(32), b"x"))


def test_weights_publisher_keeps_serving_after_a_negative_seq() -> None:
    """An attacker without the secret greets (allowed), then sends one made-up sealed message
    with seq -1: the publisher's serving thread must answer it with an error and live on."""
    import torch
    from tidekv.config import TransferConfig
    from tidekv.transfer import TransferEngine
    from tidekv.weights import protocol as p
    from tidekv.weights.publisher import Publisher

    engine = TransferEngine(config=TransferConfig(secret=SECRET))
    pub = Publisher({"w": torch.zeros(4)}, engine=engine)
    sock = _dealer(pub.address)
    try:
        session = _greet(sock, "weights", pub.address)
        sock.send(auth.encode(auth.Sealed(session, -1, bytes(32), b"")))
        assert sock.poll(3000), "the publisher stopped answering"
        reply = p.reply_decoder.decode(sock.recv())
        assert isinstance(reply, p.Error) and reply.kind == "auth"
        sock.send(p.encoder.encode(p.Versions(p.PROTOCOL_VERSION)))  # still there for everyone else
        assert sock.poll(3000), "the publisher stopped answering"
    finally:
        sock.close()
        pub.close()
        engine.close()


def test_hold_table_keeps_receiving_after_a_negative_seq() -> None:
    """Same attack on a prefill's hold table: afterwards a real, sealed release must still free
    its request's blocks before their deadline."""
    from tidekv.kvcache.handoff import HoldTable, Releaser

    table = HoldTable("127.0.0.1", hold_timeout_s=30.0, secret=SECRET)
    releaser = Releaser(SECRET)
    sock = _dealer(table.address)
    try:
        session = _greet(sock, "pd", table.address)
        sock.send(auth.encode(auth.Sealed(session, -1, bytes(32), b"")))
        time.sleep(0.5)
        table.hold("req-1")
        releaser.release(table.address, "req-1")
        deadline = time.monotonic() + 10
        while "req-1" not in (released := table.released()) and time.monotonic() < deadline:
            table.wait(0.2)
        assert "req-1" in released, "the hold table stopped receiving releases"
    finally:
        sock.close()
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
