"""tidekv for SGLang: an L3 HiCache storage backend on the tidekv store.

Select it with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "tidekv", "module_path":
"tidekv_sglang.hicache", "class_name": "TidekvHiCacheStorage", "interface_v1": 1, "master": ...}'``
(docs/guides/sglang.md). Modules: ``settings`` (our extra-config keys, validated), ``keys`` (page
keys as SGLang's Mooncake backend forms them), ``hicache`` (the ``HiCacheStorage`` subclass; imports
sglang and torch, so it is not imported here). PD transfer runs through SGLang's own mooncake
backend on ``tidekv.compat.mooncake`` (the optional Mooncake drop-in
distribution, ``plugins/mooncake``).
"""

HICACHE_MODULE = "tidekv_sglang.hicache"
HICACHE_CLASS = "TidekvHiCacheStorage"
