"""tidekv.hostaddr: which address a listener binds and advertises, and what it refuses.
Across real "hosts" (network namespaces) the same rules are checked in tests/multihost."""

from __future__ import annotations

import pytest

from tidekv.errors import ConfigError
from tidekv.hostaddr import HOST_VARIABLE, advertised_host, default_route_source, is_loopback, is_wildcard, route_source


def _own_address() -> str:
    address = default_route_source()
    if address is None:
        pytest.skip("this machine has no default route, so no non-loopback address to route to")
    return address


def test_loopback_and_wildcard_are_recognised() -> None:
    for host in ("127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("10.0.0.1", "::ffff:10.0.0.1", "example.com", "0.0.0.0"):
        assert not is_loopback(host), host
    assert is_wildcard("0.0.0.0") and is_wildcard("::") and is_wildcard("[::]") and is_wildcard("")
    assert not is_wildcard("10.0.0.1") and not is_wildcard("localhost")


def test_an_explicit_setting_wins_then_tidekv_host() -> None:
    env = {HOST_VARIABLE: "10.9.8.7"}
    assert advertised_host("10.1.1.1", ["10.2.2.2"], environ=env) == "10.1.1.1"
    assert advertised_host(None, ["10.2.2.2"], environ=env) == "10.9.8.7"
    assert advertised_host("", (), environ=env) == "10.9.8.7"
    assert advertised_host("[fd00::5]", (), environ={}) == "fd00::5"


def test_peers_on_loopback_give_loopback() -> None:
    assert advertised_host(None, (), environ={}) == "127.0.0.1"
    assert advertised_host(None, ["127.0.0.1"], environ={}) == "127.0.0.1"
    assert advertised_host(None, ["localhost", "127.0.0.2"], environ={}) == "127.0.0.1"
    assert advertised_host(None, ["::1"], environ={}) == "::1"


def test_a_remote_peer_gives_the_interface_that_routes_to_it() -> None:
    own = _own_address()
    # Routing to this machine's own address leaves from that address: the rule, checked here on
    # one host; tests/multihost checks it between namespaces.
    assert route_source(own) == own
    assert advertised_host(None, ["127.0.0.1", own], environ={}) == own
    # Unknown peers (an engine plugin with no master): the default route's interface.
    assert advertised_host(None, None, environ={}) == own


@pytest.mark.parametrize("where", ["explicit", "env"])
def test_a_wildcard_is_refused_naming_where_it_came_from(where: str) -> None:
    explicit, env = ("0.0.0.0", {}) if where == "explicit" else (None, {HOST_VARIABLE: "::"})
    with pytest.raises(ConfigError, match="wildcard") as info:
        advertised_host(explicit, (), setting="engine_host", environ=env)
    assert ("engine_host='0.0.0.0'" if where == "explicit" else f"${HOST_VARIABLE}='::'") in str(info.value)


def test_an_unresolvable_peer_names_the_variable_to_set() -> None:
    with pytest.raises(ConfigError, match=HOST_VARIABLE):
        advertised_host(None, ["no-such-host.invalid"], environ={})
