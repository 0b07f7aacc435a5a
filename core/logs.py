"""Logging setup for tidekv's command-line entry points (the library itself installs no handler)."""

from __future__ import annotations

import logging
import os


def configure_logging(level: str | int | None = None) -> None:
    """Sends tidekv's records to stderr; level from the argument, else TIDEKV_LOG_LEVEL, else INFO."""
    chosen = level if level is not None else os.environ.get("TIDEKV_LOG_LEVEL", "INFO")
    if isinstance(chosen, str):
        chosen = chosen.upper()
    logging.basicConfig(level=chosen, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
