"""``MasterPoller``: the loop a holder's background workers share (``repair_worker``,
``spill_worker``): ask the master for work about once a heartbeat, at once again while there
is work, and carry what the last round did in the next request.

A request that fails (the master away, a failover) is logged once until one succeeds; what it
carried is kept for the next round (the master ignores a repeated report). The loop ends when
``closed`` is set. Subclasses say what a round asks (``_ask``) and what it does with the answer
(``_work``, which returns whether there may be more).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tidekv.errors import TidekvError

logger = logging.getLogger(__name__)


class MasterPoller:
    def __init__(self, what: str, client_id: str, interval_s: float, closed: threading.Event, *,
                 at_once: bool = False) -> None:
        self._what = what
        self._client_id = client_id
        self._interval_s = interval_s
        self._closed = closed
        self._at_once = at_once  # the first round without waiting
        self._thread = threading.Thread(target=self._loop, name=f"tidekv-{what}-{client_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _ask(self) -> Any:
        """One request to the master; raises TidekvError when it fails."""
        raise NotImplementedError

    def _work(self, answer: Any) -> bool:
        """Does what the answer asks; True when there may be more work at once."""
        raise NotImplementedError

    def _loop(self) -> None:
        busy, warned = self._at_once, False
        while not self._closed.wait(0 if busy else self._interval_s):
            try:
                answer = self._ask()
                warned = False
            except TidekvError as exc:
                if not warned:
                    logger.warning("store client %s: asking for %s failed: %s", self._client_id, self._what, exc)
                    warned = True
                busy = False
                continue
            if self._closed.is_set():
                break  # closing: what the work needs may be gone already
            busy = self._work(answer)
