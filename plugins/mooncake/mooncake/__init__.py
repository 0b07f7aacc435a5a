"""tidekv's stand-in for Mooncake's Python package (the ``tidekv-mooncake-shim`` distribution).

Only ``mooncake.engine`` is provided, backed by ``tidekv.compat.mooncake``; Mooncake's store,
process group and EP modules are not (``import mooncake.store`` fails as if they were absent,
which is how engines detect a Mooncake without them).
"""

try:
    import tidekv.compat.mooncake  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the tidekv-mooncake-shim package routes mooncake.engine to tidekv, but tidekv is not importable here; "
        "install tidekv into this environment (pip install <tidekv checkout>)"
    ) from exc

IS_TIDEKV_SHIM = True
"""Marks this package as tidekv's shim, not Mooncake."""
