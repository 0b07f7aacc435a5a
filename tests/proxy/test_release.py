"""A failed decode leg frees the prefill's held KV blocks: the proxy tells the prefill's hold
table (a real ``HoldTable``, as a prefill worker has) through the address in the prefill's
``kv_transfer_params``; fake prefill/decode backends over loopback HTTP."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from tests.proxy.conftest import MakeBackend, StartProxy
from tests.proxy.fakes import Mode, http_request, sse_events
from tidekv.kvcache.handoff import HoldTable

COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 17, "temperature": 0}
PREFILL_REQUEST_ID = "prefill0-1"  # what the fake prefill names the first request it holds


@pytest.fixture
def hold_table() -> Iterator[HoldTable]:
    """The prefill's hold table, holding the blocks of the first request (60 s timeout: only a
    release frees them within a test)."""
    table = HoldTable("127.0.0.1", hold_timeout_s=60.0)
    table.hold(PREFILL_REQUEST_ID)
    yield table
    table.close()


def _released_within(table: HoldTable, timeout_s: float) -> float | None:
    """Seconds until the table frees the held request, or None if it does not within ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if PREFILL_REQUEST_ID in table.released():
            return time.monotonic() - started
        table.wait(0.02)
    return None


@pytest.mark.parametrize(("decode_mode", "status"), [(None, 502), (Mode.FAIL, 502), (Mode.REJECT, 400)])
def test_decode_that_never_takes_the_request_frees_the_blocks_at_once(
        backend: MakeBackend, start_proxy: StartProxy, down_url: str, hold_table: HoldTable,
        caplog: pytest.LogCaptureFixture, decode_mode: Mode | None, status: int) -> None:
    """Unreachable (None), 5xx or 4xx: the decode will not pull, so the prefill frees its blocks now."""
    caplog.set_level(logging.INFO)
    prefill = backend("prefill", hold_address=hold_table.address)
    decode = down_url if decode_mode is None else backend("decode", decode_mode)
    proxy = start_proxy([prefill], [decode], release_grace_s=30.0)
    answer = http_request(proxy + "/v1/completions", body=COMPLETION)
    assert answer.status == status, answer.body
    took = _released_within(hold_table, 2.0)
    assert took is not None and took < 1.0, "freed at once, not after the 60 s hold timeout nor the 30 s grace"
    request_id = prefill.received[0].headers["x-request-id"]
    proxy_lines = [r.getMessage() for r in caplog.records if r.name.startswith("tidekv.proxy")]
    assert any(f"request {request_id}: the decode leg failed" in m and PREFILL_REQUEST_ID in m and "now" in m
               for m in proxy_lines), proxy_lines
    freed = [r.getMessage() for r in caplog.records if r.name == "tidekv.kvcache.handoff"]
    assert any(f"request {PREFILL_REQUEST_ID}: freeing its held KV blocks now (decode_failed: proxy request "
               f"{request_id}" in m for m in freed), freed


@pytest.mark.parametrize("decode_mode", [Mode.HANG, Mode.MUTE_STREAM])
def test_decode_silent_after_taking_the_request_frees_the_blocks_after_the_grace(
        backend: MakeBackend, start_proxy: StartProxy, hold_table: HoldTable, decode_mode: Mode) -> None:
    """Silent for timeout_s (no answer, or a stream with no first token): the proxy hangs up and
    frees the prefill's blocks release_grace_s later (the decode might have been mid-pull)."""
    prefill = backend("prefill", hold_address=hold_table.address)
    proxy = start_proxy([prefill], [backend("decode", decode_mode)], timeout_s=0.5, release_grace_s=1.0)
    body = {**COMPLETION, "stream": decode_mode is Mode.MUTE_STREAM}
    started = time.monotonic()
    if body["stream"]:
        status, _, events = sse_events(proxy + "/v1/completions", body)
        assert status == 200 and "gateway_timeout" in events[-1], events
    else:
        assert http_request(proxy + "/v1/completions", body=body).status == 504
    assert _released_within(hold_table, 0.5) is None, "not before the grace"
    assert _released_within(hold_table, 3.0) is not None
    assert time.monotonic() - started >= 0.5 + 1.0


def test_decode_that_answers_leaves_the_release_to_the_decode(backend: MakeBackend, start_proxy: StartProxy,
                                                              hold_table: HoldTable) -> None:
    """A decode that answered pulled the blocks (and released them itself): the proxy says nothing,
    streaming or not, even when the client leaves mid-stream."""
    prefill = backend("prefill", hold_address=hold_table.address)
    proxy = start_proxy([prefill], [backend("decode")], release_grace_s=0.0)
    assert http_request(proxy + "/v1/completions", body=COMPLETION).status == 200
    status, _, events = sse_events(proxy + "/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert _released_within(hold_table, 0.5) is None
    assert hold_table._releases == {}, "no release message reached the prefill"


def test_params_the_proxy_cannot_read_release_nothing(backend: MakeBackend, start_proxy: StartProxy,
                                                      down_url: str) -> None:
    """A prefill without tidekv params (another connector): the decode still fails with 502."""
    proxy = start_proxy([backend("prefill", Mode.NO_KV)], [down_url])
    assert http_request(proxy + "/v1/completions", body=COMPLETION).status == 502
