"""Prefix keys, connector settings and the hold/confirm hand-off."""

from __future__ import annotations

import time

import pytest

from tidekv.errors import ConfigError
from tidekv.kvcache import prefix
from tidekv.kvcache.handoff import Confirmer, HoldTable
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


def test_hold_released_on_confirmation_or_deadline() -> None:
    table = HoldTable("127.0.0.1", hold_timeout_s=0.5)
    confirmer = Confirmer()
    try:
        table.hold("a")
        table.hold("b")
        confirmer.confirm(table.address, "a")
        confirmer.confirm(table.address, "early")  # before its hold: remembered
        deadline = time.monotonic() + 5
        released: set[str] = set()
        while "a" not in released and time.monotonic() < deadline:
            released |= table.released()
            time.sleep(0.01)
        assert "a" in released and "b" not in released
        table.hold("early")
        assert "early" in table.released()
        time.sleep(0.6)
        assert table.released() == {"b"}  # the deadline freed it
        assert table.pending == 0
    finally:
        confirmer.close()
        table.close()
