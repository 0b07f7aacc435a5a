"""Random request sequences against MasterService on a fake clock: the books always balance.

Three clients mount, unmount, put, upsert, end, revoke, get, remove, disconnect, reserve spares
and put through them (``PutBind``) and go silent in random order while time jumps (a silent one's segments are suspended, and resumed when it mounts
them again, mostly as the same incarnation). After every step: each segment's used bytes equal the aligned
sizes of the replicas that live on it (complete objects, pending puts, pending upserts and
retired versions; on a suspended segment, the replicas held there), no two replicas share an
offset, every replica sits on a mounted segment and every held one on a suspended segment,
and the pending-put index matches the tables; a writer has at most one spare, and the stats'
pending puts leave spares out. ``handle`` must never raise.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import msgspec
import pytest
from tidekv.store.allocator import align
from tidekv.store.master.journal import Mirror, decode_ops, encode_ops
from tidekv.store.master.objects import is_spare
from tidekv.store.master.service import MasterService
from tidekv.store.wire import names
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Pin, Status

from tests.store.rig import RpcFailed, ServiceRig

CLIENTS = ["c0", "c1", "c2"]
KEYS = [f"k{i}".encode() for i in range(30)]


def _check_books(rig: ServiceRig) -> None:
    segments = rig.service.segments
    table = rig.service.objects
    held_on = {name: s.segment for name, s in segments.suspended.items()}
    per_segment = {name: 0 for name in (*segments.segments, *held_on)}
    seen: dict[tuple[str, int], bytes] = {}
    entries = [(k, m.size, m.replicas, m.held) for k, m in (*table.objects.items(), *table.suspended.items())]
    entries += [(k, m.size, m.replicas, ()) for k, m in table.upserts.items()]
    entries += [(b"<retired>", size, replicas, None) for _, size, replicas, _ in table.retired]
    entries += [(k, r.size, (r.segment, r.offset), ()) for k, r in table.repairs.under_way.items()]
    for key, size, replicas, held in entries:
        flat = replicas if held is None else replicas + held
        for i in range(0, len(flat), 2):
            segment, offset = flat[i], flat[i + 1]
            if held is None:
                assert segment in per_segment, f"retired bytes on dropped segment {segment}"
            elif i < len(replicas):
                assert segment in segments.segments, f"{key!r} has a replica on unmounted segment {segment}"
            else:
                assert segment in held_on, f"{key!r} holds a replica on segment {segment}, which is not suspended"
            assert (segment, offset) not in seen, f"{key!r} and {seen[(segment, offset)]!r} share {segment}+{offset}"
            seen[(segment, offset)] = key
            per_segment[segment] += align(size)
    for name, seg in (*segments.segments.items(), *held_on.items()):
        assert seg.used == per_segment[name], f"segment {name}: allocator says {seg.used}, replicas {per_segment[name]}"
    assert segments.used == sum(per_segment[name] for name in segments.segments)
    assert all(not m.replicas and m.held and m.put is None for m in table.suspended.values())
    for key, meta in (*table.objects.items(), *table.upserts.items(), *table.suspended.items()):
        names = meta.all_replicas[::2]
        assert len(set(names)) == len(names), f"{key!r} has two replicas on one segment: {names}"
    assert not table.suspended.keys() & table.objects.keys(), "a put of a suspended key supersedes it"
    pending = [m for m in table.objects.values() if m.put is not None] + list(table.upserts.values())
    assert all(m.put is not None for m in table.upserts.values())
    assert sorted(table.pending) == sorted(m.put.token for m in pending if m.put is not None)
    by_writer: dict[str, int] = {}
    for m in pending:
        assert m.put is not None
        by_writer[m.put.writer] = by_writer.get(m.put.writer, 0) + 1
    assert table.pending_by == by_writer, "max_pending_puts counts every pending put of each writer"
    spares_of: dict[str, int] = {}
    for key, m in table.objects.items():
        if m.put is not None and is_spare(key):
            spares_of[m.put.writer] = spares_of.get(m.put.writer, 0) + 1
            assert table.spares.get(m.put.writer) == m.put.token, f"{m.put.writer}'s spare {key!r} is not its own"
    assert all(n == 1 for n in spares_of.values()), f"a writer holds several spares: {spares_of}"
    stats = rig.stats()  # (with tenants: the default tenant's, the operator's view of all)
    assert stats["keys"] == sum(1 for m in table.objects.values() if m.put is None)
    if rig.service.tenancy is None:
        assert stats["pending_puts"] == len(table.pending) - sum(spares_of.values())
        assert stats["spares"] == sum(spares_of.values())


def _step(rig: ServiceRig, rng: random.Random, tokens: list[tuple[str, bytes, int]]) -> None:
    client = rng.choice(CLIENTS)
    op = rng.random()
    if op < 0.05:
        name = f"seg-{client}-{rng.randint(0, 1)}"
        held = rig.service.segments.suspended.get(name)
        # Mostly the size it had: a holder coming back; else another segment on that memory.
        capacity = held.segment.capacity if held is not None and rng.random() < 0.8 else rng.choice([4096, 16384, 65536])
        rig.mount(client, name, capacity, incarnation=f"inc-{client}" if rng.random() < 0.9 else "another")
    elif op < 0.06:
        rig.call(p.UnmountSegment(client, f"seg-{client}-{rng.randint(0, 1)}"))
    elif op < 0.28:
        key = rng.choice(KEYS)
        slot = rig.put_start(client, key, rng.randint(1, 9000), replicas=rng.randint(1, 3),
                             pin=rng.choice([Pin.NONE] * 3 + [Pin.SOFT, Pin.HARD]), upsert=rng.random() < 0.4,
                             preferred=f"seg-{client}-0")
        if slot.status == Status.OK:
            tokens.append((client, key, slot.token))
    elif op < 0.35:  # a put that asks for a spare, or a put through the spare (maybe a stale one)
        spares = rig.__dict__.setdefault("spares", {})
        key = rng.choice(KEYS)
        if client in spares and rng.random() < 0.8:
            token, size = spares.pop(client)
            if rng.random() < 0.1:
                size += 1  # a bind of another size is refused, the spare kept
            slot = msgspec.convert(rig.call(p.PutBind(client, [key], token, size, rng.choice([Pin.NONE, Pin.SOFT]),
                                                      rng.random() < 0.3, f"seg-{client}-0", rng.random() < 0.9),
                                            client=client), p.PutSlot)
            assert slot.status in (Status.OK, Status.EXISTS, Status.STALE, Status.INVALID), slot
        else:
            slots = msgspec.convert(rig.call(p.PutStart(client, [key], [rng.randint(1, 9000)], rng.randint(1, 2),
                                                        f"seg-{client}-0", spare=True), client=client),
                                    list[p.PutSlot])
            slot = slots[0]
            if slot.status == Status.OK:
                tokens.append((client, key, slot.token))
        if slot.spare is not None:
            spares[client] = (slot.spare.token, slot.spare.size)
    elif op < 0.55 and tokens:
        writer, key, token = tokens.pop(rng.randrange(len(tokens)))
        if rng.random() < 0.8:
            rig.put_end(writer, key, token)
        else:
            rig.call(p.PutRevoke(writer, [key], [token]))
    elif op < 0.7:
        rig.get(rng.choice(KEYS), client=client)
    elif op < 0.8:
        rig.remove(rng.choice(KEYS), force=rng.random() < 0.3, client=client)
    elif op < 0.85:
        if rig.heartbeat(client):
            rig.hello(client)
    elif op < 0.86:
        rig.call(p.Disconnect(client))
        rig.hello(client)
    elif op < 0.9:  # a holder reports its repairs (most succeed, some fail, some never) and takes new ones
        mine = rig.__dict__.setdefault("repair_tasks", {}).pop(client, [])
        done = [p.RepairResult(t.key, t.token, rng.random() < 0.8) for t in mine if rng.random() < 0.9]
        rig.repair_tasks[client] = msgspec.convert(rig.call(p.Repairs(client, done)), list[p.RepairTask])
    else:
        for other in CLIENTS:
            if rng.random() < 0.97 and rig.heartbeat(other):
                rig.hello(other)
        rig.advance(rng.choice([0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0] * 5 + [4.0]))


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_the_books_balanced(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="tidekv")  # reclaim and liveness warnings are expected here
    rng = random.Random(seed)
    rig = ServiceRig(lease_ttl_s=rng.choice([0.0, 0.5, 2.0]), put_timeout_s=5.0, client_ttl_s=3.0,
                     high_watermark=rng.choice([0.5, 0.9, 1.0]), suspend_grace_s=rng.choice([0.0, 2.0, 10.0]))
    for client in CLIENTS:
        rig.hello(client)
    tokens: list[tuple[str, bytes, int]] = []
    for step in range(3000):
        try:
            _step(rig, rng, tokens)
        except RpcFailed as exc:
            assert exc.kind == "invalid", f"step {step}: {exc}"  # e.g. mounting a name another client owns
        _check_books(rig)
    assert rig.service.objects.repairs.counters.started > 0, "the load has holders lapse and repair"


def _check_tenants(rig: ServiceRig) -> None:
    """With tenants: each tenant's usage as counted from scratch, within its quota, and every
    replica of its objects on a segment of its pool."""
    table, segments = rig.service.objects, rig.service.segments
    assert {k: v for k, v in table.usage.items() if v} == {k: v for k, v in table.count_usage().items() if v}
    for tenant, quota in (table.quotas or {}).items():
        assert table.usage.get(tenant, 0) <= quota, f"tenant {tenant} beyond its quota"
    tenancy = rig.service.tenancy
    assert tenancy is not None
    everything = (*table.objects.items(), *table.upserts.items(), *table.suspended.items())
    for key, meta in everything:
        pool = tenancy.pool(names.tenant_of(key))
        for name in meta.all_replicas[::2]:
            seg = segments.segments.get(name) or segments.suspended[name].segment  # type: ignore[index]
            assert seg.tenant in pool, f"{key!r} has a replica on {name} (tenant {seg.tenant!r})"


@pytest.mark.parametrize("seed", range(4))
def test_with_tenants_the_books_balance_and_namespaces_hold(seed: int, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The same random load with c1 as tenant alice (the operator's secret and pool, a quota)
    and c2 as bob (a secret and pool of his own): the books balance as without tenants, and
    usage, quotas and placement hold after every step."""
    caplog.set_level(logging.ERROR, logger="tidekv")
    rng = random.Random(200 + seed)
    rig = _tenant_rig(lease_ttl_s=rng.choice([0.0, 0.5, 2.0]), put_timeout_s=5.0, client_ttl_s=3.0,
                      high_watermark=rng.choice([0.5, 0.9, 1.0]), suspend_grace_s=rng.choice([0.0, 2.0, 10.0]),
                      **_tenant_settings(tmp_path))
    for client in CLIENTS:
        rig.hello(client)
    tokens: list[tuple[str, bytes, int]] = []
    peak: dict[str, int] = {}
    for step in range(3000):
        try:
            _step(rig, rng, tokens)
        except RpcFailed as exc:
            assert exc.kind == "invalid", f"step {step}: {exc}"
        _check_books(rig)
        _check_tenants(rig)
        peak = {t: max(peak.get(t, 0), n) for t, n in rig.service.objects.usage.items()}
    refusals = r'^tidekv_tenant_quota_refusals_total\{tenant="alice"\} [1-9]'
    assert re.search(refusals, rig.service.metrics.render(), re.M), "the load reaches alice's quota"
    assert all(peak.get(t, 0) > 0 for t in ("", "alice", "bob")), peak


def _index(service: MasterService) -> tuple[dict[bytes, tuple[int, tuple[object, ...], int]], set[int]]:
    table = service.objects
    complete = {k: (m.size, tuple(sorted(zip(m.replicas[::2], m.replicas[1::2]))),
                    tuple(sorted(zip(m.held[::2], m.held[1::2]))), m.pin)
                for k, m in (*table.objects.items(), *table.suspended.items()) if m.put is None}
    return complete, set(table.pending)


def _tenant_settings(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "bob").write_text("bobs-secret")
    (tmp_path / "tenants.toml").write_text(f"[tenants.alice]\nquota = 40000\n"
                                           f"[tenants.bob]\nsecret_file = '{tmp_path / 'bob'}'\n")
    return {"tenants_file": str(tmp_path / "tenants.toml"), "secret": "the-masters"}


def _tenant_rig(**config: object) -> ServiceRig:
    rig = ServiceRig(**config)
    if config.get("tenants_file"):
        rig.as_tenant("c1", "alice")
        rig.as_tenant("c2", "bob")
    return rig


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("with_tenants", [False, True], ids=["plain", "tenants"])
def test_the_journal_rebuilds_the_same_index(seed: int, with_tenants: bool, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """Ops applied as they come, and a snapshot of the live tables, both rebuild (restore) a
    master with the same objects, pending puts and segments, whose books balance and whose new
    allocations never land on a replica it restored (with tenants: whose usage, quotas and
    placement hold too)."""
    caplog.set_level(logging.ERROR, logger="tidekv")
    rng = random.Random(100 + seed)
    extra = _tenant_settings(tmp_path) if with_tenants else {}
    rig = _tenant_rig(lease_ttl_s=rng.choice([0.0, 0.5, 2.0]), put_timeout_s=5.0, client_ttl_s=3.0,
                      suspend_grace_s=5.0, **extra)
    rig.service.enable_journal()
    follower = Mirror(rig.config.lease_ttl_s)
    for client in CLIENTS:
        rig.hello(client)
    tokens: list[tuple[str, bytes, int]] = []
    for step in range(1500):
        try:
            _step(rig, rng, tokens)
        except RpcFailed as exc:
            assert exc.kind == "invalid", f"step {step}: {exc}"
        follower.apply(decode_ops(encode_ops(rig.service.take_ops()[1])), rig.clock.now)
    from_snapshot = Mirror(rig.config.lease_ttl_s)
    from_snapshot.apply(rig.service.snapshot(), rig.clock.now)
    for mirror in (follower, from_snapshot):
        restored = _tenant_rig(lease_ttl_s=rig.config.lease_ttl_s, put_timeout_s=5.0, client_ttl_s=3.0, **extra)
        restored.service.restore(mirror)
        if with_tenants:
            _check_tenants(restored)
            for tenant, used in restored.service.objects.usage.items():  # retired bytes: no owner known
                assert used <= rig.service.objects.usage.get(tenant, 0)
        assert _index(restored.service) == _index(rig.service)
        assert set(restored.service.segments.segments) == set(rig.service.segments.segments)
        assert set(restored.service.segments.suspended) == set(rig.service.segments.suspended)
        assert restored.service.objects.last_token >= rig.service.objects.last_token
        _check_books(restored)
        for i in range(40):  # fill what is free: still no replica shares an offset
            for client in CLIENTS:
                restored.hello(client)
            restored.put_start(CLIENTS[i % 3], f"new-{i}".encode(), 1000)
            _check_books(restored)
            if with_tenants:
                _check_tenants(restored)


def _lru_order(service: MasterService) -> list[tuple[bytes, int]]:
    return [(key, meta.token) for key, meta in service.objects.objects.by_age() if meta.put is None]


def _allocators(service: MasterService) -> dict[str, tuple[int, dict[int, int]]]:
    segments = service.segments
    return {name: (seg.allocator.used, dict(seg.allocator._by_offset))
            for name, seg in (*segments.segments.items(), *((n, s.segment) for n, s in segments.suspended.items()))}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("lapses", [False, True], ids=["steady", "lapses"])
def test_a_columnar_snapshot_and_the_log_after_it_rebuild_the_same_master(seed: int, lapses: bool,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A journal's snapshot in columns (packed objects adopted whole, allocators from saved free
    ranges) followed by the log since rebuilds the master the ops alone rebuild: same objects in
    the same LRU order, same allocators, the same objects queued for repair (short of replicas),
    books balanced, new puts never on a restored replica.
    Holders that lapse suspend segments, drop them and make repairs while the log runs."""
    caplog.set_level(logging.ERROR, logger="tidekv")
    caplog.set_level(logging.WARNING, logger="tidekv.store.master.service")  # (a disagreement is a warning)
    rng = random.Random(500 + seed)
    ttl = rng.choice([0.0, 0.5, 2.0])
    rig = ServiceRig(lease_ttl_s=ttl, put_timeout_s=5.0, client_ttl_s=3.0 if lapses else 86400.0,
                     suspend_grace_s=5.0)
    rig.service.enable_journal()
    for client in CLIENTS:
        rig.hello(client)
    tokens: list[tuple[str, bytes, int]] = []
    journal: list[bytes] | None = None  # frames, as JournalFile writes them: the snapshot's, then the log's
    # The snapshot: from `cut` on, once packed objects are there; then a log short enough that
    # some of them are still there at the restore, and long enough to change some
    cut, after = rng.randrange(300, 1200), rng.randrange(15, 120)
    for step in range(3000):
        if journal is not None and after == 0:
            break
        try:
            _step(rig, rng, tokens)
        except RpcFailed as exc:
            assert exc.kind == "invalid", f"step {step}: {exc}"
        ops = rig.service.take_ops()[1]
        index = rig.service.objects.objects
        if journal is None and step >= cut and len(index) - index.records >= 3:
            journal = [encode_ops([op]) for op in rig.service.snapshot(columns=True)]
            order_at_cut = _lru_order(rig.service)
        elif journal is not None:
            after -= 1
            if ops:
                journal.append(encode_ops(ops))
    assert journal is not None, "a snapshot with packed objects, and a log after it"
    restored = []
    for materialize in (False, True):
        mirror = Mirror(ttl)
        for frame in journal:
            mirror.apply(decode_ops(frame), rig.clock.now)
        assert mirror.base is not None
        if materialize:
            mirror.materialize()
        elif not lapses:
            assert not mirror.suspended, "a steady pool restores from the columns"
        new = ServiceRig(lease_ttl_s=ttl, put_timeout_s=5.0, client_ttl_s=3.0, suspend_grace_s=5.0)
        new.service.restore(mirror)
        assert "disagree" not in caplog.text
        assert _index(new.service) == _index(rig.service)
        assert set(new.service.segments.segments) == set(rig.service.segments.segments)
        _check_books(new)
        restored.append(new)
    columns, ops = restored
    assert _allocators(columns.service) == _allocators(ops.service)
    assert set(columns.service.objects.repairs.degraded) == set(ops.service.objects.repairs.degraded)
    if not lapses:  # (a restore with suspended segments takes the ops' path, which places objects anew)
        # Versions snapshotted and still there keep their LRU order; what came since is newer.
        order = _lru_order(columns.service)
        kept = set(order) & set(order_at_cut)
        assert [o for o in order if o in kept] == [o for o in order_at_cut if o in kept]
        assert all(o in kept for o in order[:len(kept)])
    for i in range(40):  # fill what is free: still no replica shares an offset
        for client in CLIENTS:
            columns.hello(client)
        columns.put_start(CLIENTS[i % 3], f"new-{i}".encode(), 1000)
        _check_books(columns)


def test_a_snapshot_whose_free_ranges_disagree_with_the_log_is_rebuilt_from_every_replica(
        caplog: pytest.LogCaptureFixture) -> None:
    """Saved free ranges that leave no room for a replica the log placed are not trusted: the
    restore says so and re-reserves every replica instead, so nothing live is handed out twice."""
    rig = ServiceRig(lease_ttl_s=0.0)
    rig.service.enable_journal()
    rig.hello("c0")
    rig.mount("c0", "seg-c0-0", 65536)
    for i in range(8):
        slot = rig.put_start("c0", f"k{i}".encode(), 1000)
        rig.put_end("c0", f"k{i}".encode(), slot.token)
    rig.service.take_ops()  # (what the snapshot holds)
    ops = list(rig.service.snapshot(columns=True))
    for op in ops:
        if type(op).__name__ == "ColumnsFreeOp":
            op.free = []  # "nothing free": the put below was placed on bytes it says are in use
    mirror = Mirror(0.0)
    mirror.apply(decode_ops(encode_ops(ops)), rig.clock.now)
    new = ServiceRig(lease_ttl_s=0.0)
    rig.put_start("c0", b"after", 1000)  # the live master's journal goes on: the log
    mirror.apply(decode_ops(encode_ops(rig.service.take_ops()[1])), rig.clock.now)
    new.service.restore(mirror)
    assert "disagree on the bytes in use" in caplog.text
    assert _index(new.service) == _index(rig.service)
    _check_books(new)
    new.hello("c0")
    fresh = new.put_start("c0", b"fresh", 1000)
    assert fresh.status == Status.OK
    _check_books(new)
