"""More segments from one client (``Store.mount_segment``): engine memory or the caller's,
placed on, read by another process, and taken out again with the objects on it."""

from __future__ import annotations

import pytest
from tidekv.errors import ConfigError

from tests.store.conftest import Connect, SpawnAgent
from tests.store.procs import MasterProcess


def test_a_client_contributes_more_segments_and_takes_them_out(master: MasterProcess, spawn_agent: SpawnAgent,
                                                               connect: Connect) -> None:
    client = connect(master.address)  # a pure client: no segment of its own
    reader = spawn_agent(master.address)
    name = client.mount_segment(4 << 20)
    buf = bytearray(4 << 20)
    mine = client.mount_segment(memory=buf)
    assert client.extra_segments == [name, mine]
    client.put("a", b"a" * 1000, preferred_segment=name)
    client.put("b", b"b" * 1000, preferred_segment=mine)
    assert b"b" * 1000 in buf  # in the caller's memory
    assert reader.call("get", key="a")["size"] == 1000 and reader.call("get", key="b")["size"] == 1000
    client.unmount_segment(mine)
    assert client.exists_many(["a", "b"]) == [True, False] and client.extra_segments == [name]
    with pytest.raises(ConfigError, match="not one this client mounted"):
        client.unmount_segment(mine)
    with pytest.raises(ConfigError, match="a size or memory"):
        client.mount_segment()
