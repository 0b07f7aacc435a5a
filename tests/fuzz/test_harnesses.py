"""A short run of every fuzz harness (``harnesses``): its seeds and random mutations of them.

CI-sized by default (``TIDEKV_FUZZ_EXAMPLES``, 300 inputs per harness); the long, coverage-guided
runs are ``benchmarks/fuzz.py``'s. A crash signature listed in ``KNOWN_BUGS`` is a bug found and
not fixed yet (each has its strict xfail in ``test_found``); any other fails the test, with
the input that made it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.harnesses import HARNESSES, KNOWN_BUGS, Tally, mutations, run_one

EXAMPLES = int(os.environ.get("TIDEKV_FUZZ_EXAMPLES", "300"))
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_harness_finds_nothing_new(name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)  # each refused input logs a warning: thousands of lines
    harness = HARNESSES[name]()
    harness.setup()
    tally = Tally()
    try:
        for data in mutations(harness.seeds(), EXAMPLES, seed=17):
            run_one(harness, tally, data)
        report = harness.report()
    finally:
        harness.close()
    assert tally.inputs == EXAMPLES
    new = tally.new_crashes()
    assert not new, "\n\n".join(f"{sig}: {tally.examples[sig]}" for sig in new)
    assert tally.hangs == 0, tally.examples.get("hang")
    if name == "engine_frames":
        assert report["writes_outside_regions"] == 0
        assert report["frames_sent"] >= EXAMPLES  # the inputs became frames, most on a standing connection
        assert report["connections"] < EXAMPLES / 2
        assert report["engine_stats"]["served_bytes"] > 0  # some requests were inside the region and served


def test_fuzz_driver_runs_atheris_and_reports() -> None:
    """``benchmarks/fuzz.py`` for two seconds on one Python and one native harness: the report
    names each with its inputs, crashes and hangs, and the guard check for the native one."""
    pytest.importorskip("atheris")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fuzz.py"), "--seconds", "2",
                          "--harness", "pd_contract,engine_frames"], cwd=ROOT, capture_output=True, text=True,
                         timeout=100, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.split()[:1] in (["pd_contract"],
                                                                                                 ["engine_frames"])}
    assert set(lines) == {"pd_contract", "engine_frames"}, out.stdout
    for line in lines.values():
        assert "0 new crashes" in line and "0 hangs" in line, line
        assert int(line.split("inputs")[0].split()[-1].replace(",", "")) > 100, line
    assert "0 writes outside registered regions (checked with guard regions" in lines["engine_frames"], out.stdout


def test_known_bugs_are_listed_with_reasons() -> None:
    assert all(len(reason) > 40 for reason in KNOWN_BUGS.values())
