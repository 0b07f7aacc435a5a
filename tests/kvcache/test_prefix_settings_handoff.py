"""Prefix keys, connector settings and the hand-off (which blocks move, hold/release)."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
from tidekv import channel
from tidekv.errors import ConfigError
from tidekv.kvcache import handoff, prefix
from tidekv.kvcache.contract import PROTOCOL_VERSION, KVHandoff, RankEndpoint
from tidekv.kvcache.handoff import (
    HoldTable,
    Releaser,
    ReleaseReason,
    pull_end,
    pulled_blocks,
)
from tidekv.kvcache.settings import (
    MASTER_ENV,
    KVConnectorConfig,
    did_you_mean,
    resolve_master,
)

from tests.store import wire
from tests.store.procs import wait_until


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


def test_master_comes_from_the_extra_config_else_tidekv_master() -> None:
    env = {MASTER_ENV: "10.0.0.9:50051"}
    assert MASTER_ENV == "TIDEKV_MASTER"
    assert KVConnectorConfig.from_mapping({}, env).master == "10.0.0.9:50051"
    assert KVConnectorConfig.from_mapping({"master": "127.0.0.1:7"}, env).master == "127.0.0.1:7", "the config wins"
    assert KVConnectorConfig.from_mapping({"master": None}, env).master is None, "explicit null: no store"
    assert KVConnectorConfig.from_mapping({}, {}).master is None
    assert KVConnectorConfig.from_mapping({}, {MASTER_ENV: ""}).master is None
    assert resolve_master({}, environ={MASTER_ENV: "[::1]:50051"}) == "[::1]:50051"
    with pytest.raises(ConfigError, match=r"\$TIDEKV_MASTER='nohost' must be 'host:port'"):
        KVConnectorConfig.from_mapping({}, {MASTER_ENV: "nohost"})
    with pytest.raises(ConfigError, match=r"master='h:99999' must be 'host:port'"):
        KVConnectorConfig.from_mapping({"master": "h:99999"}, {})
    cluster = "etcd://10.0.0.1:2379,10.0.0.2:2379/pool"  # a cluster of masters, found through etcd
    assert KVConnectorConfig.from_mapping({}, {MASTER_ENV: cluster}).master == cluster
    assert KVConnectorConfig.from_mapping({"master": "etcd://h:2379/x"}, {}).master == "etcd://h:2379/x"
    with pytest.raises(ConfigError, match=r"master='etcd://h:2379' must be .*etcd://HOST:PORT"):
        KVConnectorConfig.from_mapping({"master": "etcd://h:2379"}, {})


def test_unknown_setting_suggests_the_closest_name() -> None:
    with pytest.raises(ConfigError, match=r"\['mastr'\] \(did you mean 'master'\?\); allowed \["):
        KVConnectorConfig.from_mapping({"mastr": "x:1"})
    with pytest.raises(ConfigError) as err:
        KVConnectorConfig.from_mapping({"zzz": 1})
    assert "did you mean" not in str(err.value)
    assert did_you_mean("TideKVConnector", ["TidekvConnector"]) == " (did you mean 'TidekvConnector'?)"
    assert did_you_mean("TidekvConector", ["TidekvConnector"]) == " (did you mean 'TidekvConnector'?)"
    assert did_you_mean("NixlConnector", ["TidekvConnector"]) == ""


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
def hand_off() -> Iterator[Callable[..., tuple[HoldTable, Releaser]]]:
    """Makes a prefill-side HoldTable and a decode-side Releaser; closes both afterwards."""
    made: list[tuple[HoldTable, Releaser]] = []

    def make(hold_timeout_s: float = 60.0) -> tuple[HoldTable, Releaser]:
        made.append((HoldTable("127.0.0.1", hold_timeout_s), Releaser()))
        return made[-1]

    yield make
    for table, releaser in made:
        releaser.close()
        table.close()


def _released_until(table: HoldTable, want: set[str], timeout_s: float = 5.0) -> set[str]:
    released: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not want <= released and time.monotonic() < deadline:
        table.wait(0.05)
        released |= table.released()
    return released


def test_hold_released_on_confirmation_or_deadline(hand_off: Callable[..., tuple[HoldTable, Releaser]]) -> None:
    table, releaser = hand_off(hold_timeout_s=0.5)
    held_at = time.monotonic()
    table.hold("a")
    table.hold("b")
    releaser.release(table.address, "a")
    releaser.release(table.address, "early")  # before its hold: remembered
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
        hand_off: Callable[..., tuple[HoldTable, Releaser]]) -> None:
    table, releaser = hand_off()
    releaser.release(table.address, "r")
    wait_until(lambda: "r" in table._releases, 5.0, "the receiver thread to take the release")
    assert table.released() == set()  # nothing held: nothing released, and "r" is not lost
    table.hold("r")
    assert table.wait(0) is True
    assert table.released() == {"r"}
    assert table.pending == 0


def _sender(table: HoldTable) -> socket.socket:
    """A raw, authenticated connection to ``table``'s channel."""
    host, port = table.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5.0)
    wire.authenticate(sock, None, handoff.MAGIC, "pd")
    return sock


def _release(rid: str) -> bytes:
    return channel.frame(channel.encode(channel.Envelope(PROTOCOL_VERSION, 0, handoff.HoldRelease(rid, ReleaseReason.PULLED))))


def test_malformed_confirmations_are_dropped_and_stale_ones_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "_MAX_UNPAIRED", 2)
    table = HoldTable("127.0.0.1", hold_timeout_s=0.05)
    sender = _sender(table)
    try:
        sender.sendall(channel.frame(b"\xff not msgpack"))
        sender.sendall(channel.frame(b""))  # an empty frame from a peer is just as malformed; it must not stop the receiver
        for rid in ("stray1", "stray2"):
            sender.sendall(_release(rid))
        wait_until(lambda: set(table._releases) == {"stray1", "stray2"}, 5.0, "the channel's thread to take them")
        # older than the hold timeout now (the wall time passes on purpose; the prune below needs it)
        wait_until(lambda: all(time.monotonic() - t > table.hold_timeout_s for t, _ in table._releases.values()),
                   5.0, "the strays to be older than the hold timeout", interval_s=0.01)
        table.hold("r")
        sender.sendall(_release("r"))
        assert table.wait(5.0) is True, "the receiver survived the malformed frames"
        assert table.released() == {"r"}
        assert set(table._releases) == set(), "stale unpaired confirmations were pruned"
    finally:
        sender.close()
        table.close()
    assert not table._server._thread.is_alive(), "close() stops the channel's thread"


def test_hold_wait_sleeps_until_a_confirmation_arrives(hand_off: Callable[..., tuple[HoldTable, Releaser]]) -> None:
    table, releaser = hand_off()
    table.hold("r")
    started = time.monotonic()
    assert table.wait(0.05) is False  # nothing confirmed: the whole timeout passes
    assert time.monotonic() - started >= 0.04
    releaser.release(table.address, "r")
    started = time.monotonic()
    assert table.wait(5.0) is True, "a confirmation ends the wait"
    assert time.monotonic() - started < 2.0
    assert table.released() == {"r"}


def test_releaser_close_sends_what_is_queued(hand_off: Callable[..., tuple[HoldTable, Releaser]]) -> None:
    table, releaser = hand_off()
    for i in range(50):
        table.hold(f"r{i}")
        releaser.release(table.address, f"r{i}")
    releaser.close()  # flushes the queue before closing its sockets
    assert _released_until(table, {f"r{i}" for i in range(50)}) == {f"r{i}" for i in range(50)}


def test_failed_decode_frees_the_hold_at_once_and_says_so(hand_off: Callable[..., tuple[HoldTable, Releaser]],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A release for a failed decode frees the blocks at once (not at the 60 s deadline) and is
    logged at INFO with the request id and what happened; a pull's release is not logged."""
    caplog.set_level(logging.INFO, logger="tidekv.kvcache.handoff")
    table, releaser = hand_off(hold_timeout_s=60.0)
    releaser.release(table.address, "early", ReleaseReason.DECODE_FAILED, "decode http://d:1 unreachable")
    # Ordered by the event, not a sleep: the proxy heard of the failure (its release reached the
    # table) before the prefill's worker recorded the hold.
    wait_until(lambda: "early" in table._releases, 5.0, "the early release to reach the hold table")
    assert not table.is_held("early")
    for rid in ("early", "failed", "pulled"):
        table.hold(rid)
    assert table._releases["early"][0] < table._deadlines["early"] - table.hold_timeout_s, \
        "the release for early arrived before its hold"
    releaser.release(table.address, "failed", ReleaseReason.DECODE_ENDED, "aborted")
    releaser.release(table.address, "pulled")
    started = time.monotonic()
    assert _released_until(table, {"early", "failed", "pulled"}) == {"early", "failed", "pulled"}
    assert time.monotonic() - started < 2.0
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("request early" in m and "decode_failed: decode http://d:1 unreachable" in m for m in infos), infos
    assert any("request failed" in m and "decode_ended: aborted" in m for m in infos), infos
    assert not any("request pulled" in m for m in infos)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records), "no deadline was needed"


def test_release_handoff_reaches_every_rank(hand_off: Callable[..., tuple[HoldTable, Releaser]]) -> None:
    (t0, releaser), (t1, _) = hand_off(), hand_off()
    ranks = [RankEndpoint(f"127.0.0.1:{i}", {}, t.address) for i, t in enumerate((t0, t1))]
    handoff = KVHandoff(request_id="r", engine_id="p", block_ids=[1], num_tokens=3, block_size=4, tp_size=2,
                        ranks=ranks)
    t0.hold("r")
    t1.hold("r")
    releaser.release_handoff(handoff, ReleaseReason.DECODE_FAILED, "x")
    assert _released_until(t0, {"r"}) == {"r"} and _released_until(t1, {"r"}) == {"r"}


def test_release_of_another_protocol_version_is_dropped_naming_both(caplog: pytest.LogCaptureFixture) -> None:
    table = HoldTable("127.0.0.1", hold_timeout_s=60.0)
    sender = _sender(table)
    try:
        table.hold("r")
        newer = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, 0, ["release", "r", "some_new_reason", ""]])
        sender.sendall(channel.frame(newer))
        assert table.wait(0.3) is False, "it did not release the hold"
        assert table.released() == set() and table.is_held("r")
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"protocol version {PROTOCOL_VERSION + 1}" in m and f"speaks version {PROTOCOL_VERSION}" in m
                   for m in messages), messages
        sender.sendall(_release("r"))
        assert table.wait(5.0) is True, "the channel still works"
    finally:
        sender.close()
        table.close()


def test_connector_settings_from_the_environment_as_json() -> None:
    from tidekv.kvcache.settings import CONNECTOR_CONFIG_ENV

    got = KVConnectorConfig.from_environment({CONNECTOR_CONFIG_ENV: '{"engine_port": 7000, "hold_port": 7100}',
                                              MASTER_ENV: "10.0.0.5:50051"})
    assert (got.engine_port, got.hold_port, got.master) == (7000, 7100, "10.0.0.5:50051")
    assert KVConnectorConfig.from_environment({}).engine_port == 0
    with pytest.raises(ConfigError, match="not JSON"):
        KVConnectorConfig.from_environment({CONNECTOR_CONFIG_ENV: "engine_port=7000"})
    with pytest.raises(ConfigError, match="JSON object"):
        KVConnectorConfig.from_environment({CONNECTOR_CONFIG_ENV: "[7000]"})
    with pytest.raises(ConfigError, match="did you mean 'hold_port'"):
        KVConnectorConfig.from_environment({CONNECTOR_CONFIG_ENV: '{"hold_prot": 1}'})


def test_the_engine_address_follows_the_master_unless_set() -> None:
    from tidekv.hostaddr import HOST_VARIABLE

    assert KVConnectorConfig(master="127.0.0.1:50051").listen_host({}) == "127.0.0.1"
    assert KVConnectorConfig(master="127.0.0.1:50051", engine_host="10.1.2.3").listen_host({}) == "10.1.2.3"
    assert KVConnectorConfig(master="127.0.0.1:50051").listen_host({HOST_VARIABLE: "10.4.5.6"}) == "10.4.5.6"
    for bad in ("0.0.0.0", "::"):
        with pytest.raises(ConfigError, match="wildcard"):
            KVConnectorConfig(engine_host=bad)
    with pytest.raises(ConfigError, match="hold_port=70000"):
        KVConnectorConfig(hold_port=70000)
    # Loopback while the master is elsewhere: refused at start-up, before the model loads.
    for forced in ({}, {HOST_VARIABLE: "127.0.0.1"}):
        engine_host = None if forced else "127.0.0.1"
        with pytest.raises(ConfigError, match="no other host could pull"):
            KVConnectorConfig(master="10.9.9.9:50051", engine_host=engine_host).listen_host(forced)


def test_the_hold_table_listens_on_a_set_port_and_on_ipv6() -> None:
    from tidekv.bench.ports import free_port

    port = free_port()
    table = HoldTable("127.0.0.1", hold_timeout_s=60.0, port=port)
    try:
        assert table.address == f"127.0.0.1:{port}"
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            HoldTable("127.0.0.1", hold_timeout_s=60.0, port=port)  # taken
    finally:
        table.close()
    v6 = HoldTable("::1", hold_timeout_s=60.0)
    releaser = Releaser()
    try:
        assert v6.address.startswith("[::1]:")
        v6.hold("r")
        releaser.release(v6.address, "r")
        assert _released_until(v6, {"r"}) == {"r"}
    finally:
        releaser.close()
        v6.close()
