"""Another SGLang rank on the same tidekv pool, in its own process, for the two-process tests.

Run as ``python hicache_peer.py '{"master": ..., "segment_size": N, "shape": {PoolShape fields}}'``
(with ``"backend": "mooncake"``: SGLang's own mooncake backend on the Mooncake drop-in instead).
Without "segment_size" the tidekv backend keeps its default (0: the rank holds no pool memory).
It builds a real host pool and the backend through SGLang's factory, prints {"engine"}, then answers one JSON command per stdin line: ``set`` (fill pages from a
seed, ``batch_set_v1``; answers the page digests), ``get`` (``batch_get_v1`` into pages;
answers per-page results and digests) and ``exists`` (``batch_exists`` of hashes; answers the
hit count). EOF on stdin closes the backend and exits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import traceback
from typing import Any

import sglang_rig


def main() -> int:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    sglang_rig.stub_torchvision()
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    shape = sglang_rig.PoolShape(**spec["shape"])
    pool = sglang_rig.make_host_pool(shape)
    if spec.get("backend") == "mooncake":
        extra = sglang_rig.mooncake_extra_config(spec["master"], global_segment_size=spec["segment_size"])
        config = sglang_rig.storage_config(extra, is_mla=shape.is_mla)
        backend = StorageBackendFactory.create_backend("mooncake", config, pool)
        engine = backend.store.get_hostname()
    else:
        settings = {"segment_size": spec["segment_size"]} if "segment_size" in spec else {}
        config = sglang_rig.storage_config(sglang_rig.tidekv_extra_config(spec["master"], **settings),
                                           is_mla=shape.is_mla)
        backend = StorageBackendFactory.create_backend("dynamic", config, None)
        engine = backend.store.engine.name
    backend.register_mem_pool_host(pool)
    print(json.dumps({"engine": engine}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply: dict[str, Any] = {"ok": True}
            pages, hashes = cmd.get("pages", []), cmd["hashes"]
            if cmd["cmd"] == "exists":
                reply["hits"] = backend.batch_exists(hashes)
            elif cmd["cmd"] == "set":
                sglang_rig.fill_pages(pool, pages, cmd["seed"])
                reply["results"] = backend.batch_set_v1(hashes, sglang_rig.host_indices(pool, pages))
            elif cmd["cmd"] == "get":
                reply["results"] = backend.batch_get_v1(hashes, sglang_rig.host_indices(pool, pages))
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
            reply["digests"] = [hashlib.sha256(sglang_rig.page_bytes(pool, p)).hexdigest() for p in pages]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
