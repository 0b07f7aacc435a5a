"""The names a user reaches from ``import tidekv``."""

from __future__ import annotations

import pytest

import tidekv
from tidekv.config import StoreConfig
from tidekv.store import Pin, Store


def test_store_names_are_reachable_from_the_top_level() -> None:
    assert (tidekv.Store, tidekv.Pin, tidekv.StoreConfig) == (Store, Pin, StoreConfig)
    for name in tidekv.__all__:
        assert getattr(tidekv, name) is not None, name
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        tidekv.Nope  # noqa: B018
