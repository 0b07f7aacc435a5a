"""Prefix keys, connector settings and the hand-off (which blocks move, hold/confirm)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from tidekv.errors import ConfigError
from tidekv.kvcache import handoff, prefix
from tidekv.kvcache.handoff import Confirmer, HoldTable, pull_end, pulled_blocks
from tidekv.kvcache.settings import KVConnectorConfig


def test_block_keys_chain_the_whole_prefix() -> None:
    ns = prefix.namespace("m", "float32", "abc", 4, 0, 1)
    a = prefix.block_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prefix.block_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = prefix.block_keys(ns, [0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b  # the partial last block has no key
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key


def test_namespace_separates_incompatible_engines() -> None:
    keys = {
        prefix.namespace("m", "float32", "abc", 4, 0, 1),
        prefix.namespace("m", "bfloat16", "abc", 4, 0, 1),
        prefix.namespace("m", "float32", "abd", 4, 0, 1),
        prefix.namespace("m", "float32", "abc", 8, 0, 1),
        prefix.namespace("m", "float32", "abc", 4, 1, 2),
        prefix.namespace("n", "float32", "abc", 4, 0, 1),
    }
    assert len(keys) == 6


def test_settings_refuse_unknown_and_bad_values() -> None:
    assert KVConnectorConfig.from_mapping({"master": "127.0.0.1:50051"}).master == "127.0.0.1:50051"
    with pytest.raises(ConfigError, match=r"unknown tidekv connector setting\(s\) \['mastr'\]"):
        KVConnectorConfig.from_mapping({"mastr": "x:1"})
    with pytest.raises(ConfigError, match="transport"):
        KVConnectorConfig.from_mapping({"transport": "rdma"})
    with pytest.raises(ConfigError, match="master"):
        KVConnectorConfig.from_mapping({"master": "nohostport"})
    with pytest.raises(ConfigError, match="hold_timeout_s"):
        KVConnectorConfig.from_mapping({"hold_timeout_s": 0})
    assert KVConnectorConfig().is_sync_load
    assert not KVConnectorConfig.from_mapping({"load_mode": "async"}).is_sync_load
    with pytest.raises(ConfigError, match=r"load_mode='later' is invalid; allowed \['sync', 'async'\]"):
        KVConnectorConfig.from_mapping({"load_mode": "later"})


@pytest.mark.parametrize("prompt_len", [64, 65, 66, 2000])
def test_sync_pull_takes_every_prompt_token_but_the_last(prompt_len: int) -> None:
    bs = 32
    blocks = -(-prompt_len // bs)
    end = pull_end(prompt_len, prompt_len, blocks, bs, is_sync=True)
    assert end == prompt_len - 1
    span = pulled_blocks(end, end, bs)  # nothing computed locally
    assert (span.start, span.stop) == (0, -(-(prompt_len - 1) // bs))
    # 65 tokens: tokens 0..63 fill blocks 0-1; the last token starts block 2, which the forward writes.
    if prompt_len == 65:
        assert span.stop == 2
    assert pull_end(prompt_len, prompt_len, blocks, bs, is_sync=False) == prompt_len


def test_pull_skips_the_local_hit_and_stops_at_what_the_prefill_has() -> None:
    bs = 32
    # 2 full blocks hit locally; 100 prompt tokens: blocks 2 and 3 (tokens 64..98) are pulled.
    end = pull_end(100, 100, 4, bs, is_sync=True)
    assert pulled_blocks(end, end - 64, bs) == slice(2, 4)
    # The prefill computed fewer tokens (or holds fewer blocks) than the prompt: pull only those.
    assert pull_end(100, 70, 4, bs, is_sync=True) == 70
    assert pull_end(100, 100, 2, bs, is_sync=False) == 64
    assert pull_end(1, 1, 1, bs, is_sync=True) == 0


@pytest.fixture
def hand_off() -> Iterator[Callable[..., tuple[HoldTable, Confirmer]]]:
    """Makes a prefill-side HoldTable and a decode-side Confirmer; closes both afterwards."""
    made: list[tuple[HoldTable, Confirmer]] = []

    def make(hold_timeout_s: float = 60.0) -> tuple[HoldTable, Confirmer]:
        made.append((HoldTable("127.0.0.1", hold_timeout_s), Confirmer()))
        return made[-1]

    yield make
    for table, confirmer in made:
        confirmer.close()
        table.close()


def _released_until(table: HoldTable, want: set[str], timeout_s: float = 5.0) -> set[str]:
    released: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not want <= released and time.monotonic() < deadline:
        table.wait(0.05)
        released |= table.released()
    return released


def test_hold_released_on_confirmation_or_deadline(hand_off: Callable[..., tuple[HoldTable, Confirmer]]) -> None:
    table, confirmer = hand_off(hold_timeout_s=0.5)
    held_at = time.monotonic()
    table.hold("a")
    table.hold("b")
    confirmer.confirm(table.address, "a")
    confirmer.confirm(table.address, "early")  # before its hold: remembered
    released = _released_until(table, {"a"})
    assert "a" in released and "b" not in released
    table.hold("early")
    later = _released_until(table, {"early"}, timeout_s=0.4)  # inside its own deadline: confirmed
    assert "early" in later
    later |= _released_until(table, {"b"})
    assert later == {"early", "b"}
    assert time.monotonic() - held_at >= 0.5, "only the deadline freed b"
    assert table.pending == 0


def test_confirmation_while_nothing_is_held_is_kept_for_its_hold(
        hand_off: Callable[..., tuple[HoldTable, Confirmer]]) -> None:
    table, confirmer = hand_off()
    confirmer.confirm(table.address, "r")
    deadline = time.monotonic() + 5
    while not table._confirmed and time.monotonic() < deadline:  # the receiver thread reads it
        time.sleep(0.005)
    assert table.released() == set()  # nothing held: nothing released, and "r" is not lost
    table.hold("r")
    assert table.wait(0) is True
    assert table.released() == {"r"}
    assert table.pending == 0


def test_malformed_confirmations_are_dropped_and_stale_ones_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "_MAX_UNPAIRED", 2)
    table = HoldTable("127.0.0.1", hold_timeout_s=0.05)
    sender = zmq.Context.instance().socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(f"tcp://{table.address}")
    try:
        sender.send(b"\xff not msgpack")
        sender.send(b"")  # an empty frame from a peer is just as malformed; it must not stop the receiver
        for rid in ("stray1", "stray2"):
            sender.send(handoff._encode(handoff._Done(rid)))
        time.sleep(0.1)  # older than the hold timeout now
        table.hold("r")
        sender.send(handoff._encode(handoff._Done("r")))
        assert table.wait(5.0) is True, "the receiver survived the malformed frames"
        assert table.released() == {"r"}
        assert set(table._confirmed) == set(), "stale unpaired confirmations were pruned"
    finally:
        sender.close()
        table.close()
    assert not table._thread.is_alive(), "close() stops the receiver thread"


def test_hold_wait_sleeps_until_a_confirmation_arrives(hand_off: Callable[..., tuple[HoldTable, Confirmer]]) -> None:
    table, confirmer = hand_off()
    table.hold("r")
    started = time.monotonic()
    assert table.wait(0.05) is False  # nothing confirmed: the whole timeout passes
    assert time.monotonic() - started >= 0.04
    confirmer.confirm(table.address, "r")
    started = time.monotonic()
    assert table.wait(5.0) is True, "a confirmation ends the wait"
    assert time.monotonic() - started < 2.0
    assert table.released() == {"r"}


def test_confirmer_close_sends_what_is_queued(hand_off: Callable[..., tuple[HoldTable, Confirmer]]) -> None:
    table, confirmer = hand_off()
    for i in range(50):
        table.hold(f"r{i}")
        confirmer.confirm(table.address, f"r{i}")
    confirmer.close()  # flushes the queue before closing its sockets
    assert _released_until(table, {f"r{i}" for i in range(50)}) == {f"r{i}" for i in range(50)}
