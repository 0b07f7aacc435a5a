"""Spares: a put of one small object reserves a slot for the writer's next put of that size, which
then writes first and publishes with one request (``PutBind``) - two round trips, not three.

Checked through real processes: the requests each put sends (counted at the store client's
master connection), the bytes read back, a put of an existing key through the spare (a no-op
that keeps the spare), puts of other sizes, threads putting at once (no two writes ever land in
one spare), a spare past its use window, a spare on a holder that was killed, a master with
spares off, and the reserved keys refused. The master's books with spares under random load:
``test_master_invariants.py``; a tenant binding another's spare: ``test_tenants.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from tidekv.errors import ConfigError, MasterUnavailableError
from tidekv.store import Store
from tidekv.store.wire import protocol as p

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import payload
from tests.store.procs import wait_until

MIB = 1 << 20


@contextmanager
def requests_of(st: Store) -> Iterator[list[str]]:
    """The type names of the requests ``st`` sends its master meanwhile."""
    sent: list[str] = []
    call = st._rpc.call

    def counting(request: object, *args: object, **kwargs: object) -> object:
        sent.append(type(request).__name__)
        return call(request, *args, **kwargs)  # type: ignore[arg-type]

    st._rpc.call = counting  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        st._rpc.call = call  # type: ignore[method-assign]


def _pool(spawn_master: SpawnMaster, spawn_agent: SpawnAgent, connect: Connect, **master_settings: object) -> Store:
    """A client of a master (with ``master_settings``) whose pool is one 16 MiB holder."""
    master = spawn_master(**master_settings)
    spawn_agent(master.address, 16 * MIB)
    return connect(master.address)


def test_a_small_put_after_the_first_takes_one_request_to_the_master(spawn_master: SpawnMaster,
                                                                    spawn_agent: SpawnAgent, connect: Connect) -> None:
    st = _pool(spawn_master, spawn_agent, connect)
    with requests_of(st) as sent:
        st.put("first", payload(1, 4096))
    assert sent == ["PutStart", "PutEnd"]
    for i in range(5):
        with requests_of(st) as sent:
            st.put(f"next-{i}", payload(2 + i, 4096))
        assert sent == ["PutBind"], f"put {i} through the spare"
    assert st.get("first") == payload(1, 4096)
    assert [st.get(f"next-{i}") for i in range(5)] == [payload(2 + i, 4096) for i in range(5)]
    stats = st.stats()
    assert (stats["keys"], stats["pending_puts"], stats["spares"], stats["spare_bytes"]) == (6, 0, 1, 4096)


def test_a_put_of_an_existing_key_through_the_spare_is_a_no_op_and_keeps_the_spare(
        spawn_master: SpawnMaster, spawn_agent: SpawnAgent, connect: Connect) -> None:
    st = _pool(spawn_master, spawn_agent, connect)
    st.put("k", payload(1, 1000))
    with requests_of(st) as sent:
        st.put("k", payload(2, 1000))  # immutable: a successful no-op
        st.upsert("k2", payload(3, 1000))
        st.upsert("k2", payload(4, 1000))  # replaces, through the spare the no-op kept
    assert sent == ["PutBind"] * 3
    assert st.get("k") == payload(1, 1000) and st.get("k2") == payload(4, 1000)
    assert st.stats()["spares"] == 1


def test_puts_of_other_shapes_take_the_two_phase_path_and_move_the_spare(
        spawn_master: SpawnMaster, spawn_agent: SpawnAgent, connect: Connect) -> None:
    st = _pool(spawn_master, spawn_agent, connect)
    st.put("a", payload(1, 4096))
    with requests_of(st) as sent:
        st.put("b", payload(2, 8192))  # another size
        st.put("c", payload(3, 8192))  # the spare that put left
        st.put_many(["d", "e"], [payload(4, 8192), payload(5, 8192)])  # a batch: its own two phases
        st.put("f", payload(6, 8192), replicas=1)
    assert sent == ["PutStart", "PutEnd", "PutBind", "PutStart", "PutEnd", "PutBind"]
    assert [st.get(k) for k in "abcdef"] == [payload(i + 1, n) for i, n in enumerate([4096] + [8192] * 5)]
    stats = st.stats()
    assert (stats["spares"], stats["spare_bytes"], stats["pending_puts"]) == (1, 8192, 0), \
        "the 4 KiB spare was dropped when the 8 KiB one was reserved"


def test_threads_putting_at_once_never_share_a_spare(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                     connect: Connect) -> None:
    master = spawn_master()
    spawn_agent(master.address, 64 * MIB)
    st = connect(master.address)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(150):
                st.put(f"t{t}-{i}", payload(t * 1000 + i, 2048))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for t in range(4):
        for i in range(150):
            assert st.get(f"t{t}-{i}") == payload(t * 1000 + i, 2048), f"t{t}-{i} was overwritten"
    stats = st.stats()
    assert (stats["keys"], stats["pending_puts"]) == (600, 0) and stats["spares"] <= 1


def test_a_spare_past_its_use_window_is_left_and_reclaimed_quietly(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                                   connect: Connect,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    master = spawn_master(put_timeout_s=0.4)  # a spare is used within 0.1 s of the request that got it
    spawn_agent(master.address, 16 * MIB)
    st = connect(master.address)
    st.put("a", payload(1, 512))
    threading.Event().wait(0.2)
    with requests_of(st) as sent:
        st.put("b", payload(2, 512))
    assert sent == ["PutStart", "PutEnd"], "too old to write into: the master may have reclaimed it"
    threading.Event().wait(1.0)  # past put_timeout_s: the master reclaims the unused spare
    stats = st.stats()
    assert (stats["spares"], stats["puts_reclaimed"]) == (0, 0), "an unused reservation is not a failed put"
    assert [st.get("a"), st.get("b")] == [payload(1, 512), payload(2, 512)]
    assert "reclaimed unfinished put" not in master.log_text()


def test_a_spare_on_a_killed_holder_costs_a_retry_not_the_put(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                              connect: Connect) -> None:
    master = spawn_master(client_ttl_s=30.0)
    holders = [spawn_agent(master.address, 16 * MIB) for _ in range(2)]
    st = connect(master.address)
    st.put("a", payload(1, 4096))
    held = st._io._spare
    assert held is not None
    doomed = next(h for h in holders if h.engine == held.spare.locations[0].engine)
    doomed.kill()
    st.put("b", payload(2, 4096))  # the spare's write fails: put again, away from the dead holder
    assert st.get("b") == payload(2, 4096)
    assert st._rpc.call(p.Locate([b"b"])) == [[next(h for h in holders if h is not doomed).engine]]


def test_with_spares_off_every_put_has_two_phases(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                  connect: Connect) -> None:
    st = _pool(spawn_master, spawn_agent, connect, max_spare_bytes=0)
    with requests_of(st) as sent:
        for i in range(3):
            st.put(f"k{i}", payload(i, 100))
    assert sent == ["PutStart", "PutEnd"] * 3
    assert st.stats()["spares"] == 0


def test_spares_stay_out_of_a_nearly_full_pool(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                               connect: Connect) -> None:
    master = spawn_master()
    spawn_agent(master.address, 1 * MIB)
    st = connect(master.address)
    st.put("small", payload(1, 1024))
    assert st.stats()["spares"] == 1
    st.put("big", payload(2, 900 << 10))  # a spare of this would leave the pool within an eviction round
    assert st.stats()["spares"] == 0


def test_a_reserved_key_is_refused(spawn_master: SpawnMaster, spawn_agent: SpawnAgent, connect: Connect,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    st = _pool(spawn_master, spawn_agent, connect)
    st.put("a", payload(1, 64))
    for key in (p.SPARE_MARK + b"1", p.SPARE_MARK + b"999"):
        with pytest.raises(ConfigError, match="refused key"):
            st.put(key, payload(2, 64))
        with pytest.raises(ConfigError, match="refused key"):
            st.upsert(key, payload(2, 64))
    assert st.stats()["spares"] == 1 and st.get("a") == payload(1, 64)


@pytest.mark.parametrize("how", ["sigkill", "clean-stop"])
def test_a_spare_from_a_master_that_restarted_is_never_written(how: str, spawn_master: SpawnMaster,
                                                               spawn_agent: SpawnAgent, connect: Connect) -> None:
    """A master restarted without its journal knows nothing of the spare and gives its bytes to
    another client's object: the writer must not write into it (it would overwrite that object)."""
    first = spawn_master(client_ttl_s=5.0)
    holder = spawn_agent(first.address, 8 * MIB, rpc_timeout_s=1.0)
    st = connect(first.address, rpc_timeout_s=1.0)
    st.put("a", payload(1, 4096))
    held = st._io._spare
    assert held is not None
    spare_at = held.spare.locations[0].addr
    first.kill() if how == "sigkill" else first.stop()
    second = spawn_master(port=first.port, client_ttl_s=5.0)
    other = connect(second.address, rpc_timeout_s=1.0)
    wait_until(lambda: holder.segment in other.stats()["segments"], 10.0, "the holder to re-mount its segment")
    other.put_many(["v0", "v1"], [payload(10, 4096), payload(11, 4096)])
    _, found = other._rpc.call(p.Get([b"v0", b"v1"]))
    assert spare_at in [r.locations[0].addr for r in found], "the new master placed an object on the old spare"
    try:
        st.put("b", payload(2, 4096))
    except MasterUnavailableError:  # its put_start went out on the dead connection: never acknowledged
        st.put("b", payload(2, 4096))
    assert [other.get("v0"), other.get("v1"), st.get("b")] == [payload(10, 4096), payload(11, 4096), payload(2, 4096)]
