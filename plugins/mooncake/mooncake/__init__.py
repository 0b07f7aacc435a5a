"""tidekv's stand-in for Mooncake's Python package (the ``tidekv-mooncake-shim`` distribution).

Provided, each over ``tidekv.compat``: ``mooncake.engine`` (``mooncake``), ``mooncake.store``
(``mooncake_store``, with the buffer pool), ``mooncake.mooncake_config`` (``mooncake_config``),
``mooncake.async_store`` (``mooncake_async``), ``mooncake.buffer_pool`` (``mooncake_buffer_pool``;
``BufferPool`` and ``RegisteredBufferPool`` are also this package's, as in Mooncake),
``mooncake.http_metadata_server`` (``mooncake_metadata_server``), and the commands
``mooncake_master`` (``mooncake.master``), ``mooncake_client`` (``mooncake.cli_client``) and
``mooncake_http_metadata_server``. ``mooncake.structured_object_store`` and
``mooncake.dataproto_catalog`` fail to import with a message naming what to use instead
(``mooncake_unserved``). Mooncake's process group, EP and other modules are absent (importing
them fails as for any missing module, which is how engines detect a Mooncake without them).
"""

from typing import Any

try:
    import tidekv.compat.mooncake  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the tidekv-mooncake-shim package routes mooncake.* to tidekv, but tidekv is not importable here; "
        "install tidekv into this environment (pip install <tidekv checkout>)"
    ) from exc

IS_TIDEKV_SHIM = True
"""Marks this package as tidekv's shim, not Mooncake."""

__all__ = ["BufferPool", "IS_TIDEKV_SHIM", "RegisteredBufferPool"]


def __getattr__(name: str) -> Any:
    # Mooncake's package exports its buffer pool; loaded on first use (it brings the store in).
    if name in ("BufferPool", "RegisteredBufferPool"):
        from tidekv.compat import mooncake_buffer_pool

        return getattr(mooncake_buffer_pool, name)
    raise AttributeError(f"module 'mooncake' has no attribute '{name}'")
