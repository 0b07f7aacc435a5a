"""Segment memory kinds: a memfd that peers map ("shared") or huge pages that peers reach by
cross-memory attach ("huge"); objects round-trip byte for byte through either, across processes."""

from __future__ import annotations

import pytest

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import digest, payload
from tidekv.config import StoreConfig
from tidekv.errors import ConfigError
from tidekv.transfer import huge_pages_shareable

MIB = 1 << 20
SIZES = [1, 4095, 4096, 65537, 1 * MIB, 3 * MIB + 7]


@pytest.mark.parametrize("memory", ["shared", "huge"])
def test_objects_round_trip_through_either_segment_memory(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                          connect: Connect, memory: str) -> None:
    master = spawn_master()
    holder = spawn_agent(master.address, 32 * MIB, segment_memory=memory)  # the pool's only segment
    writer = connect(master.address)
    for i, size in enumerate(SIZES):
        data = payload(i, size)
        writer.put(f"k{i}", data)
        assert writer.get(f"k{i}") == data, f"{memory}: {size} bytes read back by the writer's process"
        got = holder.call("get", key=f"k{i}")
        assert (got["size"], got["digest"]) == (size, digest(data)), f"{memory}: read by the holder itself"
    assert writer.stats()["used_bytes"] >= sum(SIZES)


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping holding ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line
    raise AssertionError(f"{address:#x} is not mapped")


@pytest.mark.parametrize("memory", ["auto", "shared", "huge"])
def test_segment_memory_setting_picks_the_backing(connect: Connect, spawn_master: SpawnMaster, memory: str) -> None:
    master = spawn_master()
    st = connect(master.address, segment_size=4 * MIB, segment_memory=memory)
    assert st._member.segment is not None
    is_memfd = "memfd:tidekv-buffer" in _mapping_of(st._member.segment.address)
    huge = memory == "huge" or (memory == "auto" and huge_pages_shareable())
    assert is_memfd == (not huge), f"segment_memory={memory}: {_mapping_of(st._member.segment.address)}"
    if huge:
        assert st._member.segment.address % (2 * MIB) == 0, "huge-page segments start on a 2 MiB boundary"


def test_unknown_segment_memory_is_refused() -> None:
    with pytest.raises(ConfigError, match="segment_memory='tmpfs' is invalid; allowed auto, shared, huge"):
        StoreConfig(segment_memory="tmpfs")
    with pytest.raises(ConfigError, match="segment_memory"):
        StoreConfig.from_env({"TIDEKV_STORE_SEGMENT_MEMORY": "bogus"})


def test_auto_stays_shared_when_the_engine_turns_cross_memory_attach_off(spawn_master: SpawnMaster) -> None:
    from tidekv.config import TransferConfig
    from tidekv.store import Store

    master = spawn_master()
    st = Store.connect(master.address, segment_size=4 * MIB, config=StoreConfig(staging_size_bytes=1 << 20),
                       transfer_config=TransferConfig(enable_cross_memory_attach=False))
    try:
        assert st._member.segment is not None
        assert "memfd:tidekv-buffer" in _mapping_of(st._member.segment.address), "peers could not attach to huge pages"
    finally:
        st.close()
