"""The modules of Mooncake's package that tidekv's drop-in does not serve, each with what to use
instead: the shim's stand-in for one raises ``not_served(its name)`` when imported, so the import
fails (``ModuleNotFoundError``, as for an absent module) with a message saying what tidekv offers.

Neighbours: ``plugins/mooncake`` (the stand-ins), ``tidekv.store.client.tensors`` (the tensor API
named below).
"""

from __future__ import annotations

_STORE_INSTEAD = ("For tensors use tidekv's Store tensor API (tidekv.Store.put_tensor / get_tensor, their batch "
                  "forms put_tensors / get_tensors and get_tensor_into); for named buffers, the drop-in's "
                  "mooncake.store.MooncakeDistributedStore (put_from / batch_put_from_multi_buffers, get_into / "
                  "batch_get_into_multi_buffers).")

NOT_SERVED: dict[str, str] = {
    "mooncake.structured_object_store": "Mooncake's structured object store (bundles of named buffers, DataProto "
                                        "payloads). " + _STORE_INSTEAD,
    "mooncake.dataproto_catalog": "Mooncake's DataProto catalog, which maps rows and fields to objects of "
                                  "mooncake.structured_object_store (not served either). " + _STORE_INSTEAD,
}
"""Module -> what it is and what to use instead."""


def not_served(module: str) -> ModuleNotFoundError:
    """The error the stand-in of ``module`` (a ``NOT_SERVED`` key) raises on import."""
    return ModuleNotFoundError(f"{module} is not provided by tidekv's Mooncake drop-in (tidekv-mooncake-shim): "
                               f"{NOT_SERVED[module]}", name=module)
