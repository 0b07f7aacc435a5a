"""Long fuzz runs of every parser of network bytes (issue 17, item 4): atheris, coverage-guided.

Each harness of ``tests/fuzz/harnesses.py`` runs in a child process of its own, one after the
other: atheris instruments tidekv's Python functions, libFuzzer mutates
inputs from the harness's seeds, and the harness drives each into the real parser (the native
ones into a live transfer engine on loopback, through ``tidekv._native``). Per harness it prints
the inputs run, the crashes (distinct signatures: new ones, and the ``KNOWN_BUGS`` found before
and not fixed yet), the hangs (an input still running after ``--input-timeout-s``: libFuzzer's
``-timeout``; the native harnesses also count a peer that neither answers nor hangs up within
their own deadline), and for ``engine_frames`` the writes outside the registered region (a
guard of a known pattern before and after it, checked after every input). A native crash kills
its child: reported with libFuzzer's reason and the input it saved under ``--artifacts``.

    python benchmarks/fuzz.py --minutes 15 [--inputs 1000000] [--harness NAME[,NAME]] [--json FILE] [--artifacts DIR]
    python benchmarks/fuzz.py --seconds 60 --harness engine_frames

``--minutes`` is the whole run's time, each harness getting an even share of what is left when
it starts (so time a harness leaves by reaching ``--inputs`` goes to the later ones);
``--seconds`` is per harness. Exit status 1 when anything new was found (a crash, a hang or a stray write).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_DUMP_EVERY_S = 1.0


def _child(name: str, seconds: float, max_inputs: int, tally_path: str, artifacts: str, input_timeout_s: int) -> None:
    """Runs one harness under atheris until ``seconds`` pass or ``max_inputs`` ran; writes its
    tally to ``tally_path`` every second (what a killed child leaves behind) and at the end, then exits."""
    import atheris

    sys.path.insert(0, str(ROOT))
    logging.disable(logging.CRITICAL)  # every refused input logs a warning
    from tests.fuzz import harnesses

    harness = harnesses.HARNESSES[name]()
    harness.setup()
    for seed in harness.seeds():  # loads what the harness imports lazily, so that it is instrumented too
        harnesses.run_one(harness, harnesses.Tally(), seed)
    _instrument_tidekv()
    tally = harnesses.Tally()
    started = time.monotonic()
    state = {"next_dump": started + _DUMP_EVERY_S}

    def dump(report: dict[str, Any] | None = None) -> None:
        body = {**tally.as_dict(), "seconds": time.monotonic() - started, "report": report}
        tmp = tally_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(body, f, default=str)
        os.replace(tmp, tally_path)

    def one(data: bytes) -> None:
        harnesses.run_one(harness, tally, data)
        now = time.monotonic()
        if now < state["next_dump"]:
            return
        state["next_dump"] = now + _DUMP_EVERY_S
        if now - started < seconds and tally.inputs < max_inputs:
            dump()
            return
        try:
            report = harness.report()
        except Exception as exc:  # noqa: BLE001 - a failed final check is a finding, reported
            sig = harnesses.signature(exc)
            tally.crashes[sig] = tally.crashes.get(sig, 0) + 1
            tally.examples.setdefault(sig, f"final check: {exc!r}")
            report = {"final_check_failed": repr(exc)}
        dump(report)
        harness.close()
        os._exit(0)

    corpus = tempfile.mkdtemp(prefix=f"fuzz-{name}-corpus-")
    for i, seed in enumerate(harness.seeds()):
        Path(corpus, f"seed-{i}").write_bytes(seed)
    atheris.Setup([sys.argv[0], f"-timeout={input_timeout_s}", "-rss_limit_mb=4096", "-max_len=8192",
                   f"-artifact_prefix={artifacts}/{name}-", f"-max_total_time={int(seconds) + 120}", corpus], one)
    atheris.Fuzz()


def _instrument_tidekv() -> int:
    """Adds atheris's coverage and comparison hooks to every function of tidekv (and of the
    harnesses: their comparisons guide it too) loaded so far.

    Not ``instrument_imports(include=["tidekv"])``: in this venv (tidekv an editable install)
    it instrumented nothing (libFuzzer saw 6 edges); not ``instrument_all()``: it takes ~20 s
    over numpy's and torch's functions too. Returns the functions instrumented.
    """
    import atheris

    funcs = [obj for obj in gc.get_objects() if isinstance(obj, types.FunctionType)
             and str(getattr(obj, "__module__", "")).startswith(("tidekv", "tests.fuzz"))]
    for func in funcs:
        atheris.instrument_func(func)
    print(f"instrumented {len(funcs)} tidekv functions", file=sys.stderr)
    return len(funcs)


def _run(name: str, seconds: float, max_inputs: int, artifacts: Path, input_timeout_s: int) -> dict[str, Any]:
    tally_path = artifacts / f"{name}.tally.json"
    log_path = artifacts / f"{name}.log"
    tally_path.unlink(missing_ok=True)
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, __file__, "--child", name, "--seconds", str(seconds),
                               "--inputs", str(max_inputs), "--artifacts", str(artifacts), "--input-timeout-s", str(input_timeout_s)],
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=seconds + 300, check=False)
    result: dict[str, Any] = {"inputs": 0, "crashes": {}, "hangs": 0, "examples": {}, "report": None}
    if tally_path.exists():
        result.update(json.loads(tally_path.read_text()))
    result["wall_s"] = time.monotonic() - started
    result["exit_code"] = proc.returncode
    if proc.returncode != 0:  # the child died: a native crash, libFuzzer's timeout or its memory limit
        text = log_path.read_text(errors="replace")
        reason = next((line.strip() for line in text.splitlines() if "ERROR: libFuzzer" in line or
                       "==ERROR" in line), f"exit code {proc.returncode}")
        if "timeout" in reason:
            result["hangs"] += 1
        else:
            result["crashes"][f"process died: {reason}"] = 1
        result["died"] = {"reason": reason, "log": str(log_path),
                          "saved_inputs": sorted(str(p) for p in artifacts.glob(f"{name}-*"))}
    return result


def _line(name: str, r: dict[str, Any]) -> str:
    from tests.fuzz.harnesses import KNOWN_BUGS

    seconds = r.get("seconds") or r["wall_s"]
    new = {s: n for s, n in r["crashes"].items() if s not in KNOWN_BUGS}
    known = {s: n for s, n in r["crashes"].items() if s in KNOWN_BUGS}
    text = (f"{name:17} {r['inputs']:>11,} inputs in {seconds:6.0f} s ({r['inputs'] / max(seconds, 1e-9):8,.0f}/s): "
            f"{len(new)} new crashes, {sum(new.values())} inputs; {len(known)} known bug(s), "
            f"{sum(known.values())} inputs; {r['hangs']} hangs")
    report = r.get("report") or {}
    if "writes_outside_regions" in report:
        text += (f"; {report['writes_outside_regions']} writes outside registered regions (checked with guard "
                 f"regions around them: {report['guard_bytes']} bytes each side, {report['frames_sent']:,} frames)")
    if report.get("inputs_by_kind"):
        text += "\n    inputs by kind: " + ", ".join(f"{k} {n:,}" for k, n in report["inputs_by_kind"].items())
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, help="the whole run's time, split evenly over the harnesses")
    parser.add_argument("--seconds", type=float, help="time per harness (instead of --minutes)")
    parser.add_argument("--inputs", type=int, default=0,
                        help="stop a harness once it ran this many inputs; the time it leaves goes to the harnesses after "
                             "it (default: run each for its whole time)")
    parser.add_argument("--harness", default="", help="comma-separated names (default: all)")
    parser.add_argument("--artifacts", default="", help="folder for logs, tallies and saved inputs (default: a temp dir)")
    parser.add_argument("--input-timeout-s", type=int, default=20, help="an input running longer is a hang (20)")
    parser.add_argument("--json", default="", help="write every harness's results here")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tally_path = str(Path(args.artifacts) / f"{args.child}.tally.json")
        _child(args.child, args.seconds, args.inputs or sys.maxsize, tally_path, args.artifacts, args.input_timeout_s)
        return 0
    sys.path.insert(0, str(ROOT))
    from tests.fuzz.harnesses import HARNESSES, KNOWN_BUGS

    names = [n for n in args.harness.split(",") if n] or list(HARNESSES)
    unknown = [n for n in names if n not in HARNESSES]
    if unknown:
        parser.error(f"unknown harness(es) {unknown}; there are: {', '.join(HARNESSES)}")
    if (args.minutes is None) == (args.seconds is None):
        parser.error("give --minutes (whole run) or --seconds (per harness)")
    budget_s = args.seconds * len(names) if args.seconds is not None else args.minutes * 60
    artifacts = Path(args.artifacts or tempfile.mkdtemp(prefix="tidekv-fuzz-"))
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"fuzzing {len(names)} harness(es) for {budget_s:.0f} s in all"
          f"{f', each up to {args.inputs:,} inputs' if args.inputs else ''}; logs and saved inputs in {artifacts}",
          flush=True)
    results: dict[str, Any] = {}
    deadline = time.monotonic() + budget_s
    for i, name in enumerate(names):
        seconds = max(1.0, (deadline - time.monotonic()) / (len(names) - i))  # an even share of what is left
        results[name] = _run(name, seconds, args.inputs, artifacts, args.input_timeout_s)
        print(_line(name, results[name]), flush=True)
    found = False
    for name, r in results.items():
        for sig, n in r["crashes"].items():
            is_known = sig in KNOWN_BUGS
            found |= not is_known
            print(f"  {name}: {sig} x{n}{' (known: ' + KNOWN_BUGS[sig][:90] + '...)' if is_known else ''}")
            example = r["examples"].get(sig)
            if example and not is_known:
                print("    first input (hex) and traceback:\n    " + example.replace("\n", "\n    ")[:3000])
        if r.get("died"):
            print(f"  {name}: the child died ({r['died']['reason']}); log {r['died']['log']}, saved "
                  f"{r['died']['saved_inputs']}")
        found |= r["hangs"] > 0 or bool((r.get("report") or {}).get("writes_outside_regions"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
