"""``store.master.shards.LruTable`` against an OrderedDict doing the same operations: the shards merge into
the exact least-recently-used order the object table's single dict had."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from tidekv.store.master.shards import LruTable


class Meta:
    __slots__ = ("name", "used")

    def __init__(self, name: str) -> None:
        self.name = name
        self.used = 0


def test_matches_an_ordered_dict_under_random_operations() -> None:
    rng = random.Random(3)
    table: LruTable[bytes, Meta] = LruTable(shards=8)
    model: OrderedDict[bytes, Meta] = OrderedDict()
    for step in range(20_000):
        key = b"k%d" % rng.randrange(500)
        action = rng.random()
        if action < 0.35:  # insert, or assign an existing key (keeps its place)
            meta = Meta(f"{key!r}@{step}")
            table[key] = meta
            model[key] = meta
        elif action < 0.6:  # a get: to the most-recently-used end
            if key in model:
                assert table.move_to_end(key) is model[key]
                model.move_to_end(key)
            else:
                with pytest.raises(KeyError):
                    table.move_to_end(key)
        elif action < 0.8:
            assert table.pop(key, None) is model.pop(key, None)
        elif action < 0.9 and key in model:
            del table[key]
            del model[key]
        else:
            assert table.get(key) is model.get(key)
            assert (key in table) == (key in model)
        if step % 997 == 0:
            assert [(k, v.name) for k, v in table.by_age()] == [(k, v.name) for k, v in model.items()]
    assert len(table) == len(model) and bool(table) == bool(model)
    assert [k for k, _ in table.by_age()] == list(model)
    assert sorted(table) == sorted(model) and sorted(k for k, _ in table.items()) == sorted(model)
    assert {v.name for v in table.values()} == {v.name for v in model.values()}


def test_keys_spread_over_shards_and_the_oldest_come_first() -> None:
    table: LruTable[bytes, Meta] = LruTable(shards=64)
    for i in range(1000):
        table[b"%d" % i] = Meta(str(i))
    table.move_to_end(b"0")
    table[b"1"] = Meta("1 again")  # assigning keeps its place
    oldest = [k for k, _ in table.by_age()][:3]
    assert oldest == [b"1", b"2", b"3"]
    assert [k for k, _ in table.by_age()][-1] == b"0"
    assert sum(1 for shard in table._shards if shard) > 32, "keys land in many shards"


def test_empty_table_and_missing_keys() -> None:
    table: LruTable[bytes, Meta] = LruTable()
    assert not table and len(table) == 0 and list(table.by_age()) == []
    assert table.get(b"x") is None and b"x" not in table
    with pytest.raises(KeyError):
        table.pop(b"x")
    with pytest.raises(KeyError):
        del table[b"x"]
    with pytest.raises(KeyError):
        table[b"x"]


def test_changing_the_table_while_iterating_raises_as_a_dict_does() -> None:
    table: LruTable[bytes, Meta] = LruTable(shards=1)
    table[b"a"], table[b"b"] = Meta("a"), Meta("b")
    with pytest.raises(RuntimeError):
        for key in table:
            table[key + b"!"] = Meta("new")


@pytest.mark.parametrize("shards", [0, 3, 100])
def test_shard_count_must_be_a_power_of_two(shards: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        LruTable(shards=shards)


def test_load_keeps_each_shards_order_and_later_touches_come_after() -> None:
    given = [(b"%d" % i, Meta(str(i))) for i in range(2000)]
    table: LruTable[bytes, Meta] = LruTable(shards=16)
    table.load(given)
    assert len(table) == 2000
    for shard in table._shards:
        assert list(shard) == sorted(shard, key=int), "a shard keeps the order it was given"
    order = [int(k) for k, _ in table.by_age()]
    assert sorted(order) == list(range(2000))
    shifts = [abs(pos - i) for pos, i in enumerate(order)]
    # tens of places on average across hash seeds (a random order: ~667)
    assert sum(shifts) / len(shifts) < 100, "across shards, close to the given order"
    assert {int(k) for k, _ in list(table.by_age())[-200:]} >= set(range(1950, 2000)), "the newest stay newest"
    table[b"new"] = Meta("new")
    table.move_to_end(b"0")
    assert [k for k, _ in table.by_age()][-2:] == [b"new", b"0"], "stamps after a load are newer than it"
