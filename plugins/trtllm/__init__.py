"""tidekv's TensorRT-LLM plugin.

Two parts, each behind one of TensorRT-LLM's documented hooks:

- ``libtransfer_engine.so`` (built from ``capi/`` next to ``tidekv._native``): Mooncake's C API
  (``transfer_engine_c.h``) over tidekv's native engine, for ``cache_transceiver_config:
  {backend: MOONCAKE}``. TensorRT-LLM's ``libtensorrt_llm_mooncake_wrapper.so`` finds it by that
  name on ``LD_LIBRARY_PATH``; ``tidekv trtllm-lib`` prints the directory to put there.
- ``tidekv_trtllm.connector``: a KV cache connector (``kv_connector_config``) for prefix reuse
  through the tidekv store; its logic lives in ``tidekv.kvcache``.
"""

from __future__ import annotations

from pathlib import Path

LIBRARY_NAME = "libtransfer_engine.so"


def library_dir() -> Path:
    """The directory holding ``libtransfer_engine.so`` (what ``LD_LIBRARY_PATH`` needs).

    Raises:
        FileNotFoundError: the library was not built (``pip install .`` builds it).
    """
    here = Path(__file__).resolve().parent / "lib"
    if not (here / LIBRARY_NAME).is_file():
        raise FileNotFoundError(f"{here / LIBRARY_NAME} does not exist: it is built with tidekv's native module "
                                "(pip install -e . from the source tree)")
    return here


def header_dir() -> Path:
    """The directory holding ``transfer_engine_c.h`` (tidekv's declaration of the same API)."""
    return Path(__file__).resolve().parent / "capi"
