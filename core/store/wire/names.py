"""Tenant names as both sides of the store write them: the name rule, the client's
``TIDEKV_TENANT``, and the ``\\0<tenant>\\0`` prefix the master puts on every name a tenant sends.

What tenants are and what they may spend is the master's (``tidekv.store.master.tenants``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from tidekv.errors import ConfigError

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A tenant's name: 1-64 letters, digits, '_', '.', '-', not starting with a punctuation mark."""
SEP = "\0"
"""Opens and closes a tenant's prefix; no name a client sends may begin with it."""
DEFAULT = ""
"""The default tenant: clients that name none."""
ENV_VARIABLE = "TIDEKV_TENANT"
"""Where a client takes its tenant from when its code names none."""


def check_name(name: str, what: str = "tenant") -> str:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is not a tenant name: 1-64 letters, digits, '_', '.' or '-', "
                          "starting with a letter or digit")
    return name


def tenant_from_env(environ: dict[str, str] | None = None) -> str:
    """``TIDEKV_TENANT`` ("" when unset: the default tenant). Raises ConfigError for a bad name."""
    name = (environ if environ is not None else os.environ).get(ENV_VARIABLE, "")
    return check_name(name, ENV_VARIABLE) if name else DEFAULT


def prefix(name: str) -> str:
    """What every name of tenant ``name`` is prefixed with inside the master ("" for the default)."""
    return f"{SEP}{name}{SEP}" if name else ""


def tenant_of(internal: str | bytes) -> str:
    """The tenant an internal key, client id or segment name belongs to."""
    if isinstance(internal, bytes):
        if internal[:1] != b"\0":
            return DEFAULT
        end = internal.find(b"\0", 1)
        return internal[1:end].decode() if end > 0 else DEFAULT
    if internal[:1] != SEP:
        return DEFAULT
    end = internal.find(SEP, 1)
    return internal[1:end] if end > 0 else DEFAULT


def owns(tenant: str) -> Callable[[bytes], bool]:
    """Whether an internal key belongs to ``tenant``."""
    if not tenant:
        return lambda key: key[:1] != b"\0"
    pre = prefix(tenant).encode()
    return lambda key: key.startswith(pre)


def strip(internal: str, pre: str) -> str:
    return internal[len(pre):] if pre and internal.startswith(pre) else internal


def plain(internal: str) -> str:
    """An internal name without its tenant's prefix (for messages)."""
    return strip(internal, prefix(tenant_of(internal)))
