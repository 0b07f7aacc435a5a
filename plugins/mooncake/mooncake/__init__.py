"""tidekv's stand-in for Mooncake's Python package (the ``tidekv-mooncake-shim`` distribution).

Provided: ``mooncake.engine`` (``tidekv.compat.mooncake``), ``mooncake.store``
(``tidekv.compat.mooncake_store``) and the ``mooncake_master`` command (``mooncake.master``,
over ``tidekv.compat.mooncake_master``). Mooncake's process group, EP and other modules are not
(importing them fails as if they were absent, which is how engines detect a Mooncake without them).
"""

try:
    import tidekv.compat.mooncake  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the tidekv-mooncake-shim package routes mooncake.* to tidekv, but tidekv is not importable here; "
        "install tidekv into this environment (pip install <tidekv checkout>)"
    ) from exc

IS_TIDEKV_SHIM = True
"""Marks this package as tidekv's shim, not Mooncake."""
