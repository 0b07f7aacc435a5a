"""Per-client limits (issue 17, item 6): a client cannot make the master hold more of its pending
puts than ``max_pending_puts``; the refusal is typed (``LimitExceededError``), counted, names the
limit, and does nothing; the client's next puts pass once some end."""

from __future__ import annotations

import msgspec
import pytest
from tidekv.errors import LimitExceededError
from tidekv.store.client.rpc import MasterChannel
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Status

from tests.store.conftest import SpawnMaster
from tests.store.rig import RpcFailed, ServiceRig


def test_pending_puts_beyond_the_limit_are_refused_and_nothing_is_done() -> None:
    rig = ServiceRig(max_pending_puts=4)
    for c in ("greedy", "other"):
        rig.hello(c)
    rig.mount("other", "seg", 1 << 20)
    slots = msgspec.convert(rig.call(p.PutStart("greedy", [b"a", b"b", b"c"], [4096] * 3)), list[p.PutSlot])
    with pytest.raises(RpcFailed) as err:
        rig.call(p.PutStart("greedy", [b"d", b"e"], [4096] * 2))
    assert err.value.kind == p.ErrorKind.LIMIT and "max_pending_puts=4" in err.value.message
    assert not rig.exists(b"d") and len(rig.service.objects.pending) == 3, "nothing of the refused request was done"
    assert rig.put_start("other", b"x", 4096).status == Status.OK, "the limit is per client"
    assert rig.put_end("greedy", b"a", slots[0].token) == Status.OK
    assert [s.status for s in msgspec.convert(rig.call(p.PutStart("greedy", [b"d", b"e"], [4096] * 2)),
                                              list[p.PutSlot])] == [Status.OK, Status.OK]
    assert 'tidekv_master_limit_refusals_total{limit="max_pending_puts"} 1.0' in rig.service.metrics.render()


def test_a_client_over_its_limit_gets_limit_exceeded_error(spawn_master: SpawnMaster) -> None:
    master = spawn_master(max_pending_puts=2)
    channel = MasterChannel(master.address, "greedy", 5.0)
    try:
        channel.call(p.Hello("greedy", p.PROTOCOL_VERSION))
        channel.call(p.MountSegment("greedy", "seg", "127.0.0.1:1", 1 << 40, 1 << 20))
        with pytest.raises(LimitExceededError, match="max_pending_puts=2"):
            channel.call(p.PutStart("greedy", [b"a", b"b", b"c"], [4096] * 3))
        assert channel.call(p.Exists([b"a"])) == [False]
    finally:
        channel.close()
