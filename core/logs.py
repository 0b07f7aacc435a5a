"""Logging setup for tidekv's command-line entry points (the library itself installs no handler),
and ``WarnEvery`` for warnings that would otherwise repeat on every request."""

from __future__ import annotations

import logging
import os
import time


class WarnEvery:
    """Lets a repeated warning through at most once per ``interval_s``; counts the ones held back."""

    def __init__(self, interval_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self._last = float("-inf")
        self._held_back = 0

    def due(self) -> int | None:
        """None if the warning is held back now; else how many were held back since the last one."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held_back += 1
            return None
        self._last, held_back, self._held_back = now, self._held_back, 0
        return held_back


def configure_logging(level: str | int | None = None) -> None:
    """Sends tidekv's records to stderr; level from the argument, else TIDEKV_LOG_LEVEL, else INFO."""
    chosen = level if level is not None else os.environ.get("TIDEKV_LOG_LEVEL", "INFO")
    if isinstance(chosen, str):
        chosen = chosen.upper()
    logging.basicConfig(level=chosen, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
