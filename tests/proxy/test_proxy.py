"""The proxy in this process, against fake prefill/decode backends over real loopback HTTP."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse

import pytest

from tests.proxy.conftest import MakeBackend, StartProxy
from tests.proxy.fakes import Mode, engine_of, handoff_params, http_request, sse_events
from tidekv.proxy import RoutingPolicy

COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 17, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 9}


def test_completion_goes_through_prefill_then_decode_with_its_params(backend: MakeBackend,
                                                                    start_proxy: StartProxy) -> None:
    prefill, decode = backend("prefill"), backend("decode")
    proxy = start_proxy([prefill], [decode])
    answer = http_request(proxy + "/v1/completions", body=COMPLETION)
    assert answer.status == 200, answer.body
    assert answer.json()["served_by"] == "decode0"

    [sent_p] = prefill.received
    assert sent_p.path == "/v1/completions"
    assert sent_p.body is not None
    assert sent_p.body["max_tokens"] == 1 and sent_p.body["stream"] is False
    assert sent_p.body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert sent_p.body["prompt"] == COMPLETION["prompt"]

    [sent_d] = decode.received
    assert sent_d.body is not None
    assert sent_d.body["max_tokens"] == 17 and sent_d.body["prompt"] == COMPLETION["prompt"]
    assert sent_d.body["kv_transfer_params"] == handoff_params("prefill0-1", "prefill0"), "passed on unchanged"
    assert sent_p.headers["x-request-id"] == sent_d.headers["x-request-id"]


def test_chat_completion_caps_both_token_limits_at_the_prefill(backend: MakeBackend, start_proxy: StartProxy) -> None:
    prefill, decode = backend("prefill"), backend("decode")
    proxy = start_proxy([prefill], [decode])
    answer = http_request(proxy + "/v1/chat/completions", body=CHAT)
    assert answer.status == 200, answer.body
    [sent_p], [sent_d] = prefill.bodies(), decode.bodies()
    assert prefill.received[0].path == decode.received[0].path == "/v1/chat/completions"
    assert sent_p["max_tokens"] == 1 and sent_p["max_completion_tokens"] == 1
    assert sent_d["max_completion_tokens"] == 9 and "max_tokens" not in sent_d
    assert sent_d["messages"] == CHAT["messages"]
    assert engine_of(sent_d["kv_transfer_params"]) == "prefill0"


def test_stream_is_passed_through_in_order_as_it_arrives(backend: MakeBackend, start_proxy: StartProxy) -> None:
    first_seen = threading.Event()
    prefill, decode = backend("prefill"), backend("decode", stream_chunks=6, first_chunk_gate=first_seen)
    proxy = start_proxy([prefill], [decode])
    started = time.monotonic()
    status, headers, events = sse_events(proxy + "/v1/completions", {**COMPLETION, "stream": True,
                                                                    "stream_options": {"include_usage": True}},
                                         on_first=first_seen)
    # The decode holds chunks 1.. back until the test has seen chunk 0 (or 5 s pass): a buffering proxy is slow.
    assert time.monotonic() - started < 4.0, "the first chunk reached the client only at the end of the stream"
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [f"tok{i}" for i in range(6)]
    assert prefill.bodies()[0]["stream"] is False and "stream_options" not in prefill.bodies()[0]
    assert decode.bodies()[0]["stream"] is True and decode.bodies()[0]["stream_options"] == {"include_usage": True}


def test_client_leaving_a_stream_aborts_it_at_the_decode(backend: MakeBackend, start_proxy: StartProxy,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tidekv.proxy")
    gate = threading.Event()
    decode = backend("decode", stream_chunks=100, chunk_interval_s=0.02, first_chunk_gate=gate)
    proxy = start_proxy([backend("prefill")], [decode])
    parsed = urllib.parse.urlsplit(proxy)
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=10)
    conn.request("POST", "/v1/completions", body=json.dumps({**COMPLETION, "stream": True}))
    assert conn.getresponse().readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    gate.set()
    assert decode.stream_aborted.wait(5.0), "the decode kept streaming after the client left"
    assert "client left a stream" in caplog.text and "ERROR" not in caplog.text


def test_round_robin_alternates_two_prefills_and_two_decodes(backend: MakeBackend, start_proxy: StartProxy) -> None:
    prefills, decodes = [backend("prefill"), backend("prefill")], [backend("decode"), backend("decode")]
    proxy = start_proxy(prefills, decodes)
    served = [http_request(proxy + "/v1/completions", body=COMPLETION).json()["served_by"] for _ in range(4)]
    assert served == ["decode0", "decode1", "decode0", "decode1"]
    assert [len(p.received) for p in prefills] == [2, 2]
    engines = [engine_of(d.bodies()[i]["kv_transfer_params"]) for i in range(2) for d in decodes]
    assert engines == ["prefill0", "prefill1", "prefill0", "prefill1"], "each decode got its own prefill's params"


def test_prefix_policy_routes_a_repeated_prompt_to_the_same_prefill(backend: MakeBackend,
                                                                   start_proxy: StartProxy) -> None:
    prefills = [backend("prefill"), backend("prefill")]
    proxy = start_proxy(prefills, [backend("decode")], policy=RoutingPolicy.PREFIX)
    long_prompt = "You are a careful assistant. " * 40  # 1160 characters: 4 full chunks of 256

    def send(prompt: str) -> str:
        before = [len(p.received) for p in prefills]
        assert http_request(proxy + "/v1/completions", body={**COMPLETION, "prompt": prompt}).status == 200
        [name] = [p.name for p, n in zip(prefills, before) if len(p.received) > n]
        return name

    first = send(long_prompt)
    assert [send(long_prompt) for _ in range(3)] == [first] * 3
    assert send(long_prompt + " And one more question?") == first
    unrelated = {send(f"Unrelated document number {i}. " * 30) for i in range(2)}
    assert unrelated == {"prefill0", "prefill1"}


def test_prefill_without_params_still_decodes_and_warns(backend: MakeBackend, start_proxy: StartProxy,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    decode = backend("decode")
    proxy = start_proxy([backend("prefill", Mode.NO_KV)], [decode])
    with caplog.at_level(logging.WARNING, logger="tidekv.proxy"):
        answer = http_request(proxy + "/v1/completions", body=COMPLETION)
    assert answer.status == 200
    assert "kv_transfer_params" not in decode.bodies()[0]
    assert "without kv_transfer_params" in caplog.text


def test_down_prefill_gives_502_naming_it_quickly(backend: MakeBackend, start_proxy: StartProxy,
                                                  down_url: str) -> None:
    decode = backend("decode")
    proxy = start_proxy([down_url], [decode])
    started = time.monotonic()
    answer = http_request(proxy + "/v1/completions", body=COMPLETION)
    assert time.monotonic() - started < 3.0
    assert answer.status == 502
    error = answer.json()["error"]
    assert error["code"] == 502 and error["type"] == "bad_gateway"
    assert down_url in error["message"] and "prefill" in error["message"]
    assert decode.received == [], "no decode without a prefill"


def test_down_decode_gives_502_naming_it(backend: MakeBackend, start_proxy: StartProxy, down_url: str) -> None:
    proxy = start_proxy([backend("prefill")], [down_url])
    answer = http_request(proxy + "/v1/completions", body={**COMPLETION, "stream": True})
    assert answer.status == 502
    assert down_url in answer.json()["error"]["message"] and "decode" in answer.json()["error"]["message"]


def test_hanging_prefill_gives_504_within_the_timeout(backend: MakeBackend, start_proxy: StartProxy) -> None:
    hanging = backend("prefill", Mode.HANG)
    proxy = start_proxy([hanging], [backend("decode")], timeout_s=1.0)
    started = time.monotonic()
    answer = http_request(proxy + "/v1/completions", body=COMPLETION)
    assert 0.9 < time.monotonic() - started < 4.0
    assert answer.status == 504
    error = answer.json()["error"]
    assert error["code"] == 504 and error["type"] == "gateway_timeout" and hanging.url in error["message"]


def test_stalled_stream_ends_with_an_error_event(backend: MakeBackend, start_proxy: StartProxy) -> None:
    decode = backend("decode", Mode.STALL_STREAM)
    proxy = start_proxy([backend("prefill")], [decode], timeout_s=1.0)
    status, _, events = sse_events(proxy + "/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    assert json.loads(events[0])["choices"][0]["text"] == "tok0"
    error = json.loads(events[-1])["error"]
    assert error["code"] == 504 and decode.url in error["message"]


@pytest.mark.parametrize(("mode", "status"), [(Mode.FAIL, 502), (Mode.REJECT, 400)])
def test_backend_error_status_is_mapped_and_names_the_backend(backend: MakeBackend, start_proxy: StartProxy,
                                                              mode: Mode, status: int) -> None:
    failing = backend("prefill", mode)
    proxy = start_proxy([failing], [backend("decode")])
    answer = http_request(proxy + "/v1/completions", body=COMPLETION)
    assert answer.status == status
    message = answer.json()["error"]["message"]
    assert failing.url in message and "prefill0 says no" in message


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_bad_client_json_gives_400(backend: MakeBackend, start_proxy: StartProxy, raw: bytes) -> None:
    prefill = backend("prefill")
    proxy = start_proxy([prefill], [backend("decode")])
    answer = http_request(proxy + "/v1/chat/completions", raw=raw)
    assert answer.status == 400
    assert answer.json()["error"]["code"] == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    assert prefill.received == []


def test_health_reports_each_backend(backend: MakeBackend, start_proxy: StartProxy, down_url: str) -> None:
    prefill, decode = backend("prefill"), backend("decode")
    healthy = http_request(start_proxy([prefill], [decode]) + "/health", method="GET")
    assert healthy.status == 200 and healthy.json()["status"] == "ok"
    assert [(b["role"], b["url"], b["status"]) for b in healthy.json()["backends"]] == [
        ("prefill", prefill.url, 200), ("decode", decode.url, 200)]

    degraded = http_request(start_proxy([prefill, down_url], [decode]) + "/health", method="GET")
    assert degraded.status == 503 and degraded.json()["status"] == "degraded"
    down = degraded.json()["backends"][1]
    assert down["url"] == down_url and down["healthy"] is False and down_url in down["error"]


def test_models_is_forwarded_to_a_decode(backend: MakeBackend, start_proxy: StartProxy) -> None:
    prefill, decode = backend("prefill"), backend("decode")
    answer = http_request(start_proxy([prefill], [decode]) + "/v1/models", method="GET")
    assert answer.status == 200 and answer.json()["served_by"] == "decode0"
    assert prefill.received == []
