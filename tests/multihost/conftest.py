"""The ``multihost`` fixture: rigs of hosts made of network namespaces (``rig.Rig``) for one test.

``multihost(n_hosts, pods={pod: node})`` makes a rig and returns it; every rig is closed after
the test, however it ended. A test skips, with the reason, only where this machine lacks what a
rig needs (root; ``ip``, ``sh``, ``mount`` and, for pods, ``unshare``; namespaces, bridges and
veths the kernel will make); once those are there, a rig that fails to come up fails the test. A failed test's
report lists its rigs' hosts. Neighbours: ``rig.py``, ``test_rig.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping

import pytest

from tests.multihost.namespaces import RigError
from tests.multihost.rig import Rig, missing_prerequisites

MakeRig = Callable[..., Rig]
"""``make(n_hosts: int, *, pods: Mapping[int, int] | None = None, nics: int = 1) -> Rig``"""

_RIGS = pytest.StashKey[list[Rig]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and item.stash.get(_RIGS, []):
        report.sections.append(("multihost rigs", "\n".join(rig.describe() for rig in item.stash[_RIGS])))
    return report


@pytest.fixture
def multihost(request: pytest.FixtureRequest) -> Iterator[MakeRig]:
    """Factory: ``multihost(n_hosts, pods={pod index: node index}, nics=1)`` returns a ``Rig``, closed after the test.

    Skips the test (naming what is missing, with the failed command's stderr) where no rig can be
    made here.
    """
    rigs: list[Rig] = []
    request.node.stash[_RIGS] = rigs

    def make(n_hosts: int, *, pods: Mapping[int, int] | None = None, nics: int = 1) -> Rig:
        reason = missing_prerequisites(with_pods=bool(pods))
        if reason is not None:
            pytest.skip(f"multihost rig: {reason}")
        rig = Rig(n_hosts, pods=pods, nics=nics)
        rigs.append(rig)
        return rig

    yield make
    errors = []
    for rig in reversed(rigs):
        try:
            rig.close()
        except RigError as e:
            errors.append(str(e))
    if errors:
        raise RigError("; ".join(errors))
