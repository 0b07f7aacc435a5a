"""Tenants (issue 17, item 3): one master, namespaces that do not touch.

Service level (``ServiceRig``, each client's requests on a connection of its tenant): for every
request type, what a tenant sends naming another tenant's keys, clients, tokens or segments
changes nothing of the other's; placement keeps a tenant's objects where its pool is; quotas
evict the tenant's own objects and then refuse with the quota named; pool pressure never
evicts another tenant's objects. Over sockets: the handshake picks the tenant's secret, the
default tenant and strangers are kept out, and tenants with secrets of their own cannot reach
each other's memory on the data path either.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tidekv.config import StoreConfig, TransferConfig
from tidekv.errors import AuthenticationError, ConfigError, ObjectNotFoundError, OutOfSpaceError, TransferError
from tidekv.store.client.store import Store
from tidekv.store.master import tenants
from tidekv.store.wire import names
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Status
from tidekv.transfer import TransferEngine, TransferOp, TransferRequest

from tests.store.conftest import SpawnMaster
from tests.store.rig import RpcFailed, ServiceRig

MASTER_SECRET = "the-operators-secret"
BOB_SECRET = "bobs-own-secret"
SEG = 1 << 20
"""Capacity of every segment here."""


def _write_tenants(tmp_path: Path, body: str) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    return str(path)


def _tenants_file(tmp_path: Path) -> str:
    """alice: shares the operator's secret and pool, 64 KiB quota; bob: a secret of his own, no
    quota; carol: shares the pool, no quota."""
    (tmp_path / "bob.secret").write_text(BOB_SECRET + "\n")
    return _write_tenants(tmp_path, f"""
[tenants.alice]
quota = "64 KiB"

[tenants.bob]
secret_file = "{tmp_path / 'bob.secret'}"

[tenants.carol]
""")


@pytest.fixture
def rig(tmp_path: Path) -> ServiceRig:
    return _rig(tmp_path)


def _rig(tmp_path: Path, lease_ttl_s: float = 0.0) -> ServiceRig:
    """Clients: op (the default tenant, segment "shared"), a1 (alice, "a-seg"), b1 (bob,
    "b-seg"), c1 (carol, no segment); each said hello and mounted."""
    r = ServiceRig(tenants_file=_tenants_file(tmp_path), secret=MASTER_SECRET, lease_ttl_s=lease_ttl_s)
    for client, tenant, segment in (("op", "", "shared"), ("a1", "alice", "a-seg"), ("b1", "bob", "b-seg"),
                                    ("c1", "carol", "")):
        if tenant:
            r.as_tenant(client, tenant)
        r.hello(client)
        if segment:
            r.mount(client, segment, SEG)
    return r


def _segments_of(slot: p.PutSlot | p.GetResult) -> set[str]:
    return {loc.segment for loc in slot.locations}


# ---- every request type -------------------------------------------------------------------


def _alice_state(rig: ServiceRig) -> dict[str, Any]:
    """Everything of alice another tenant must not change."""
    got = rig.get(b"k", client="a1")
    return {"k": (got.status, got.size, [(loc.segment, loc.engine, loc.addr) for loc in got.locations]),
            "stats": rig.stats(client="a1"), "alive": "\0alice\0a1" in rig.service.segments.clients,
            "pending": sorted(k for k in rig.service.objects.pending.values() if k.startswith(b"\0alice\0"))}


REQUEST_TYPES = typing.get_args(p.Body)


@pytest.mark.parametrize("kind", REQUEST_TYPES, ids=lambda k: k.__name__)
def test_a_tenant_cannot_touch_another_tenants_objects(rig: ServiceRig, kind: type) -> None:
    """Bob sends each request naming what alice has - her key, her pending put's key and
    token, her client, her segment and its memory - and alice's objects, pending put, client
    and segment are exactly as before; bob gets answers about his own namespace only."""
    alice = rig.put("a1", b"k", 4096)
    pending = rig.put_start("a1", b"p", 4096)
    spare = msgspec.convert(rig.call(p.PutStart("a1", [b"s"], [4096], spare=True), client="a1"), list[p.PutSlot])[0].spare
    assert alice.status == Status.OK and pending.status == Status.OK and spare is not None
    a_base = rig.bases["a-seg"]
    assert rig.call(p.ChannelPush("c", [b"k"], 10, 1 << 30), client="a1") == [[Status.OK], [0]]  # alice's channel
    before = _alice_state(rig)
    assert before["stats"]["keys"] == 1 and before["stats"]["segments"].keys() == {"a-seg"}
    rig.as_tenant("b2", "bob")  # a connection of bob's that has not said hello yet
    examples: dict[type, tuple[msgspec.Struct, Any]] = {
        p.Hello: (p.Hello("a1", p.PROTOCOL_VERSION), None),  # on b2: bob's own client "a1"
        p.MountSegment: (p.MountSegment("b1", "a-seg", "engine-of-a-seg", a_base, SEG), "invalid"),
        p.UnmountSegment: (p.UnmountSegment("b1", "a-seg"), False),
        p.Heartbeat: (p.Heartbeat("a1", segments=["a-seg"]), "invalid"),
        p.Disconnect: (p.Disconnect("a1"), "invalid"),
        p.PutStart: (p.PutStart("b1", [b"k", b"p"], [4096, 4096], upsert=True), None),
        p.PutBind: (p.PutBind("b1", [b"k"], spare.token, 4096), None),  # alice's spare: not bob's to take
        p.PutEnd: (p.PutEnd("b1", [b"p"], [pending.token]), [Status.STALE]),
        p.PutRevoke: (p.PutRevoke("b1", [b"p", b"p"], [pending.token, 0]), [Status.STALE, Status.STALE]),
        p.Get: (p.Get([b"k", b"p"]), None),
        p.Exists: (p.Exists([b"k", b"p"]), [False, False]),
        p.Locate: (p.Locate([b"k"]), [[]]),
        p.Remove: (p.Remove([b"k", b"p"], force=True), [Status.NOT_FOUND, Status.NOT_FOUND]),
        p.StatsRequest: (p.StatsRequest(), None),
        p.ListKeys: (p.ListKeys(True), ([], True)),
        p.Repairs: (p.Repairs("b1", [p.RepairResult(b"k", alice.token, True)]), []),
        p.ChannelPush: (p.ChannelPush("c", [b"k"], 10, 1 << 30), [[Status.NOT_FOUND], [-1]]),  # bob has no k
        # alice's pending put: not bob's to end, nor to append to bob's channel
        p.ChannelPublish: (p.ChannelPublish("b1", [b"p"], [pending.token], "c", 10, 1 << 30),
                           [[Status.STALE], [Status.NOT_FOUND], [-1]]),
        p.ChannelTake: (p.ChannelTake("c", "me", 10, 5.0), [0.0, []]),  # bob's channel c is empty
        p.ChannelAck: (p.ChannelAck("c", [0]), [Status.NOT_FOUND]),
        p.ChannelInfo: (p.ChannelInfo("c"), {"items": 0, "ready": 0, "taken": 0, "bytes": 0, "next_seq": 0,
                                             "lost": 0}),
        p.CreateTask: (p.CreateTask(0, [b"k"], ["a-seg"]), "invalid"),  # bob has no k, nor a segment a-seg
        p.QueryTask: (p.QueryTask([1, 2]), None),
        # bob's own disk "d", and a record of bob's own "k": alice's k is not touched
        p.Spills: (p.Spills("b1", [p.DiskInfo("d", "e:1", "e:2", 1 << 20)],
                            [p.SpillDone(b"k", alice.token, "d", 4096, 4096, 0)], report=True), [[], [], True, []]),
    }
    body, expected = examples[kind]
    try:
        result = rig.call(body, client="b2" if kind is p.Hello else "b1")
    except RpcFailed as exc:
        assert expected == exc.kind, f"{kind.__name__}: refused ({exc}), expected {expected!r}"
        assert "\0" not in exc.message and "\\x00" not in exc.message, "messages name things as the tenant does"
    else:
        assert expected != "invalid", f"{kind.__name__} was served: {result!r}"
        if kind is p.Get:
            assert [r[0] for r in result[1]] == [Status.NOT_FOUND, Status.NOT_FOUND]
        elif kind is p.PutStart:  # bob's own objects, on bob's own segment
            slots = msgspec.convert(result, list[p.PutSlot])
            assert [s.status for s in slots] == [Status.OK, Status.OK]
            assert all(_segments_of(s) == {"b-seg"} for s in slots)
        elif kind is p.PutBind:
            slot = msgspec.convert(result, p.PutSlot)
            assert slot.status == Status.STALE and slot.spare is None
        elif kind is p.StatsRequest:
            assert result["tenant"] == "bob" and result["keys"] == 0 and set(result["segments"]) == {"b-seg"}
        elif expected is not None:
            assert result == expected or list(result) == list(expected), f"{kind.__name__}: {result!r}"
    assert _alice_state(rig) == before
    assert rig.put_end("a1", b"p", pending.token) == Status.OK, "alice's pending put still ends"
    assert rig.exists(b"p", client="a1") and not rig.exists(b"p", client="op")


def test_the_default_tenant_cannot_name_into_a_namespace(rig: ServiceRig) -> None:
    rig.put("a1", b"k", 4096)
    internal = names.prefix("alice").encode() + b"k"
    for body in (p.Get([internal]), p.Exists([internal]), p.Remove([internal], force=True),
                 p.PutStart("op", [internal], [1]), p.Hello("\0alice\0a1", p.PROTOCOL_VERSION),
                 p.MountSegment("op", "\0alice\0x", "e", 1 << 40, SEG), p.Heartbeat("op", segments=["\0alice\0a-seg"])):
        with pytest.raises(RpcFailed) as err:
            rig.call(body, client="op")
        assert err.value.kind == "invalid" and "reserved" in err.value.message, body
    assert rig.exists(b"k", client="a1") and rig.stats(client="op")["keys"] == 1


def test_same_names_in_two_tenants_are_two_things(rig: ServiceRig) -> None:
    """One key, one client id and one segment name in two tenants: independent."""
    a = rig.put("a1", b"same", 4096)
    rig.as_tenant("x", "bob")
    rig.hello("x")
    rig.call(p.MountSegment("x", "a-seg", "engine-of-a-seg", 1 << 50, SEG))  # bob's own "a-seg" (other memory)
    b = rig.put_start("b1", b"same", 8192, preferred="a-seg")
    assert b.status == Status.OK and _segments_of(b) == {"a-seg"} and b.locations[0].engine == "engine-of-a-seg"
    assert b.locations[0].addr != a.locations[0].addr
    assert rig.put_end("b1", b"same", b.token) == Status.OK
    assert rig.get(b"same", client="a1").size == 4096 and rig.get(b"same", client="b1").size == 8192
    assert rig.remove(b"same", client="b1") == Status.OK
    assert rig.exists(b"same", client="a1") and not rig.exists(b"same", client="b1")


# ---- placement, quotas, eviction ------------------------------------------------------------


def test_each_tenants_objects_stay_in_its_pool(rig: ServiceRig) -> None:
    """bob (own secret): his segment only, even when it is full; alice and carol (the master's
    secret): theirs and the operator's; the operator: its own only."""
    seen: dict[str, set[str]] = {"op": set(), "a1": set(), "b1": set(), "c1": set()}
    for i in range(300):
        for client in seen:
            slot = rig.put(client, f"k{i}".encode(), 16 << 10, replicas=2)
            if slot.status == Status.OK:
                seen[client] |= _segments_of(slot)
    assert seen == {"op": {"shared"}, "a1": {"a-seg", "shared"}, "b1": {"b-seg"}, "c1": {"shared"}}


def test_a_quota_evicts_the_tenants_own_objects_then_refuses_naming_it(rig: ServiceRig) -> None:
    rig.put("op", b"op-old", 4096)
    rig.put("c1", b"carol-old", 4096)
    for i in range(16):  # alice: 16 x 4 KiB = her 64 KiB quota
        assert rig.put("a1", f"a{i}".encode(), 4096).status == Status.OK
    assert rig.stats(client="a1")["used_bytes"] == 64 << 10
    assert rig.put("a1", b"a16", 4096).status == Status.OK  # her oldest goes
    assert not rig.exists(b"a0", client="a1") and rig.exists(b"a1", client="a1")
    assert rig.exists(b"op-old", client="op") and rig.exists(b"carol-old", client="c1")
    for i in range(1, 17):  # all of hers hard-pinned now (upserts): nothing of hers can go
        assert rig.put("a1", f"a{i}".encode(), 4096, upsert=True, pin=p.Pin.HARD).status == Status.OK
    refused = rig.put("a1", b"a17", 4096)
    assert refused.status == Status.QUOTA
    assert "quota of 65536 bytes" in refused.detail and "'alice'" in refused.detail
    too_big = rig.put("a1", b"huge", 128 << 10)
    assert too_big.status == Status.QUOTA and "more than the tenant's whole quota" in too_big.detail
    stats = rig.stats(client="a1")
    assert stats["quota_bytes"] == 64 << 10 and stats["used_bytes"] == 64 << 10 and stats["keys"] == 16
    metrics = rig.service.metrics.render()
    assert 'tidekv_tenant_quota_refusals_total{tenant="alice"} 2.0' in metrics
    assert 'tidekv_tenant_used_bytes{tenant="alice"} 65536.0' in metrics
    assert rig.exists(b"op-old", client="op") and rig.exists(b"carol-old", client="c1")


def test_pool_pressure_evicts_only_the_tenants_own_objects(rig: ServiceRig) -> None:
    """The operator's segment full of its objects: carol's puts there find no room (she may
    evict only hers); once she has objects there, her puts evict those, never the operator's."""
    i = SEG // (64 << 10)
    for j in range(i):
        assert rig.put("op", f"op{j}".encode(), 64 << 10).status == Status.OK
    assert rig.service.segments.segments["shared"].allocator.free == 0
    assert rig.put("c1", b"c0", 64 << 10).status == Status.OUT_OF_SPACE
    assert rig.remove(b"op0", client="op") == Status.OK
    assert rig.put("c1", b"c0", 64 << 10).status == Status.OK
    assert rig.put("c1", b"c1", 64 << 10).status == Status.OK  # evicts c0, not an operator's object
    assert not rig.exists(b"c0", client="c1") and rig.exists(b"c1", client="c1")
    assert all(rig.exists(f"op{j}".encode(), client="op") for j in range(1, i))


def test_watermark_eviction_spares_quota_bounded_tenants(tmp_path: Path) -> None:
    """Housekeeping on a full operator segment evicts the operator's and carol's (unbounded)
    objects, never alice's: her quota bounds her."""
    r = ServiceRig(tenants_file=_tenants_file(tmp_path), secret=MASTER_SECRET, lease_ttl_s=0.0, high_watermark=0.5)
    r.hello("op")
    r.mount("op", "shared", SEG)
    for client, tenant in (("a1", "alice"), ("c1", "carol")):
        r.as_tenant(client, tenant)
        r.hello(client)
    for i in range(8):
        assert r.put("a1", f"a{i}".encode(), 8 << 10).status == Status.OK  # 64 KiB, alice's quota
    for i in range(30):
        r.put("op", f"op{i}".encode(), 16 << 10)
        r.put("c1", f"c{i}".encode(), 16 << 10)
    r.advance(0.2)
    used = r.service.segments.used
    assert used <= 0.5 * SEG
    assert all(r.exists(f"a{i}".encode(), client="a1") for i in range(8))
    assert r.service.objects.counters.evictions > 0


def test_usage_follows_every_way_bytes_are_freed(tmp_path: Path) -> None:
    """Upserts (retired versions), removes, revokes and an unmount: each tenant's usage equals
    a count from scratch after each (``test_master_invariants`` checks it under random load)."""
    rig = _rig(tmp_path, lease_ttl_s=1.0)
    for i in range(6):
        rig.put("a1", f"a{i}".encode(), 4096, replicas=2)
        rig.put("b1", f"b{i}".encode(), 4096)
    books = rig.service.objects

    def check() -> None:
        counted = {k: v for k, v in books.count_usage().items() if v}
        assert {k: v for k, v in books.usage.items() if v} == counted

    check()
    rig.get(b"a0", client="a1")
    rig.put("a1", b"a0", 4096, upsert=True)  # the old version is retired under a lease
    check()
    slot = rig.put_start("a1", b"a9", 4096)
    rig.call(p.PutRevoke("a1", [b"a9"], [slot.token]))
    rig.remove(b"a1", client="a1")
    check()
    rig.call(p.UnmountSegment("a1", "a-seg"))
    check()
    rig.advance(2.0)
    check()
    assert books.usage["alice"] == books.count_usage()["alice"] > 0


# ---- the tenants file -----------------------------------------------------------------------


@pytest.mark.parametrize(("body", "message"), [
    ("[tenants.'al ice']\n", "not a tenant name"),
    ("[tenants.alice]\nquota = 'lots'\n", "quota"),
    ("[tenants.alice]\nquota = 0\n", "quota"),
    ("[tenants.alice]\nsecrets = 'x'\n", "unknown setting"),
    ("[tenant.alice]\n", "unknown table"),
    ("", "names no tenant"),
    ("[tenants.alice\n", "not valid TOML"),
    ("[tenants.alice]\nsecret_file = '/nonexistent/alice.secret'\n", "cannot be read"),
])
def test_a_bad_tenants_file_is_refused_naming_what_is_wrong(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tenants.load(_write_tenants(tmp_path, body), MASTER_SECRET)


def test_tenant_secrets_need_a_master_secret_and_differ(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("one")
    (tmp_path / "b").write_text("one")
    own = _write_tenants(tmp_path, f"[tenants.alice]\nsecret_file = '{tmp_path / 'a'}'\n")
    with pytest.raises(ConfigError, match="the master has none"):
        tenants.load(own, None)
    with pytest.raises(ConfigError, match="secret is the master's"):
        tenants.load(own, "one")
    both = _write_tenants(tmp_path, f"[tenants.alice]\nsecret_file = '{tmp_path / 'a'}'\n"
                                    f"[tenants.bob]\nsecret_file = '{tmp_path / 'b'}'\n")
    with pytest.raises(ConfigError, match="same secret"):
        tenants.load(both, "master")
    loaded = tenants.load(_tenants_file(tmp_path), MASTER_SECRET)
    assert loaded["alice"] == tenants.Tenant("alice", None, 64 << 10) and loaded["bob"].secret == BOB_SECRET
    assert loaded["alice"].shares_pool and not loaded["bob"].shares_pool


# ---- over sockets -----------------------------------------------------------------------------

CONFIG = StoreConfig(staging_size_bytes=1 << 20, rpc_timeout_s=5.0, failover_timeout_s=0.0, heartbeat_interval_s=0.2)


def _store(address: str, secret: str | None, tenant: str, segment: int = SEG) -> Store:
    return Store.connect(address, segment, config=CONFIG, transfer_config=TransferConfig(secret=secret), tenant=tenant)


def test_tenants_over_the_wire(spawn_master: SpawnMaster, tmp_path: Path) -> None:
    master = spawn_master(secret=MASTER_SECRET, tenants_file=_tenants_file(tmp_path))
    with _store(master.address, MASTER_SECRET, "alice") as alice, _store(master.address, BOB_SECRET, "bob") as bob, \
            _store(master.address, MASTER_SECRET, "") as op:
        alice.put("k", b"a" * 4096)
        bob.put("k", b"b" * 8192)
        assert alice.get("k") == b"a" * 4096 and bob.get("k") == b"b" * 8192
        with pytest.raises(ObjectNotFoundError):
            op.get("k")
        assert list(alice.keys()) == [b"k"] and list(op.keys()) == []
        assert bob.stats()["tenant"] == "bob" and set(bob.stats()["segments"]) == {bob.segment_name}
        with pytest.raises(OutOfSpaceError, match="quota of 65536 bytes"):
            alice.put("big", b"x" * (128 << 10))
        # Data path: bob's engine (his own secret) cannot read alice's memory, nor she his.
        where = alice._rpc.call(p.Get([b"k"]))[1][0].locations[0]
        buf = bob.engine.allocate(4096)
        with pytest.raises(TransferError):
            bob.engine.transfer([TransferRequest(TransferOp.READ, buf.address, 4096, where.engine, where.addr)]).wait(5)
        assert alice.get("k") == b"a" * 4096


@pytest.mark.parametrize(("secret", "tenant", "message"), [
    (MASTER_SECRET, "bob", "failed to prove"),  # bob's tenant with the operator's secret
    (BOB_SECRET, "alice", "failed to prove"),  # bob's secret as alice
    (BOB_SECRET, "", "failed to prove"),  # bob's secret as the default tenant
    (MASTER_SECRET, "mallory", "does not know"),
])
def test_a_tenant_must_prove_its_own_secret(spawn_master: SpawnMaster, tmp_path: Path, secret: str, tenant: str,
                                            message: str) -> None:
    master = spawn_master(secret=MASTER_SECRET, tenants_file=_tenants_file(tmp_path))
    with pytest.raises(AuthenticationError, match=message):
        _store(master.address, secret, tenant, segment=0)
    with _store(master.address, BOB_SECRET, "bob", segment=0) as bob:  # the master serves on
        assert list(bob.keys()) == []


def test_a_tenant_is_refused_by_a_master_without_tenants(spawn_master: SpawnMaster) -> None:
    master = spawn_master()
    with pytest.raises(AuthenticationError, match="serves no tenants"):
        _store(master.address, None, "alice", segment=0)


def test_the_tenant_comes_from_the_environment(spawn_master: SpawnMaster, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    master = spawn_master(secret=MASTER_SECRET, tenants_file=_tenants_file(tmp_path))
    monkeypatch.setenv("TIDEKV_TENANT", "carol")
    with Store.connect(master.address, 0, config=CONFIG, transfer_config=TransferConfig(secret=MASTER_SECRET)) as c:
        assert c.stats()["tenant"] == "carol"
    monkeypatch.setenv("TIDEKV_TENANT", "no way")
    with pytest.raises(ConfigError, match="TIDEKV_TENANT"):
        Store.connect(master.address, 0, config=CONFIG)


def test_an_engine_for_each_tenant_is_its_own(tmp_path: Path) -> None:
    """Engines with different secrets refuse each other, both ways (what keeps a tenant with a
    secret of its own out of everyone else's memory)."""
    with TransferEngine(config=TransferConfig(secret=BOB_SECRET)) as b, \
            TransferEngine(config=TransferConfig(secret=MASTER_SECRET)) as a:
        region = a.allocate(4096)
        local = b.allocate(4096)
        with pytest.raises(TransferError):
            b.transfer([TransferRequest(TransferOp.READ, local.address, 4096, a.name, region.address)]).wait(5)


def test_channels_of_tenants_are_apart(tmp_path: Path) -> None:
    rig = _rig(tmp_path)
    for client, key in (("a1", b"x"), ("b1", b"y")):
        rig.put(client, key, 4096, pin=p.Pin.HARD)
        assert rig.call(p.ChannelPush("c", [key], 10, 1 << 30), client) == [[Status.OK], [0]]
    for client, key in (("a1", b"x"), ("b1", b"y")):
        items = msgspec.convert(rig.call(p.ChannelTake("c", "me", 10, 5.0), client)[1], list[p.ChannelItem])
        assert [i.key for i in items] == [key]  # its own names back
        assert items[0].locations and all("\0" not in loc.segment for loc in items[0].locations)
    assert rig.call(p.ChannelAck("c", [0]), "a1") == [Status.OK]
    assert not rig.exists(b"x", client="a1") and rig.exists(b"y", client="b1")
