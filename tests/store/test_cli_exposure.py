"""``tidekv master`` / ``tidekv up`` warn when they listen beyond this host without a secret."""

from __future__ import annotations

import pytest

from tidekv.store.cli import exposure_warning


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_warning(host: str) -> None:
    assert exposure_warning(host, "tidekv master", None) is None
    assert exposure_warning(host, "tidekv master", "s3cret") is None


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.7", "::", "master.example"])
def test_beyond_this_host_without_a_secret_is_warned(host: str) -> None:
    warning = exposure_warning(host, "tidekv master", None)
    assert warning is not None and host in warning and "TIDEKV_SECRET" in warning
    # With a secret every client must prove it (tests/store/test_auth.py): nothing to warn of.
    assert exposure_warning(host, "tidekv master", "s3cret") is None
