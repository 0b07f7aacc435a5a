"""What the HA tests across hosts run on a rig host to read masters' ``/health``, as a script
(the test process has no route to the hosts). Each prints JSON lines on stdout.

    master_health.py once URL...    one line: a list, per URL, of its health ({"role", "serving",
                                    "master_id", "insync", ...}) or {"error": str}
    master_health.py watch URL...   until killed, one line whenever a URL's (role, serving) changes,
                                    polled every ``WATCH_INTERVAL_S``: {"url", "role", "serving",
                                    "master_id", "sent", "received", "previous_sent"}; role "down"
                                    when it did not answer. The new state held at some moment
                                    between ``sent`` and ``received``, the old one still at some
                                    moment after ``previous_sent`` (the poll before): times in
                                    CLOCK_MONOTONIC seconds, which every network namespace of a
                                    machine shares with the test process

Stdlib only (it runs under ``python -I``). Neighbours: ``test_ha_hosts.py``,
``tidekv.store.master.server`` (what ``/health`` answers).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from typing import Any

WATCH_INTERVAL_S = 0.05
TIMEOUT_S = 0.5
"""A master that does not answer within this is taken as down (it answers in milliseconds)."""
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def health(url: str) -> dict[str, Any]:
    try:
        with _OPENER.open(url, timeout=TIMEOUT_S) as response:
            out: dict[str, Any] = json.loads(response.read())
            return out
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def watch(urls: list[str]) -> None:
    last: dict[str, tuple[str, bool]] = {}
    previous_sent: dict[str, float | None] = dict.fromkeys(urls)
    while True:
        for url in urls:
            sent = time.monotonic()
            h = health(url)
            received = time.monotonic()
            state = (str(h.get("role", "down")), bool(h.get("serving", False)))
            if last.get(url) != state:
                last[url] = state
                print(json.dumps({"url": url, "role": state[0], "serving": state[1], "master_id": h.get("master_id"),
                                  "sent": sent, "received": received, "previous_sent": previous_sent[url]}),
                      flush=True)
            previous_sent[url] = sent
        time.sleep(WATCH_INTERVAL_S)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "once":
        print(json.dumps([health(url) for url in args]), flush=True)
    elif command == "watch":
        watch(args)
    else:
        sys.exit(f"unknown command {command!r}: once or watch")
