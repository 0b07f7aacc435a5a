"""tidekv_trtllm.connector against TensorRT-LLM's KV cache connector API.

TensorRT-LLM cannot be installed here, so the adapter is checked two ways: its classes define
every method of the reference API (``../shared/reference/sglang_trtllm.md`` section 4.5, from
TensorRT-LLM's ``kv_cache_connector.py``) with the same parameters, read from the source
without importing it; and, where ``tensorrt_llm`` imports, the module loads and its classes
subclass TensorRT-LLM's. The logic it runs is tested in ``tests/kvcache/test_prefix_reuse.py``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "plugins" / "trtllm" / "connector.py"

SCHEDULER_API = {
    "__init__": ["self", "llm_args"],
    "build_connector_meta": ["self", "scheduler_output"],
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "request_finished": ["self", "request", "cache_block_ids"],
    "update_state_after_alloc": ["self", "request", "block_ids"],
}
WORKER_API = {
    "__init__": ["self", "llm_args"],
    "register_kv_caches": ["self", "kv_cache_tensor"],
    "start_load_kv": ["self", "stream"],
    "wait_for_layer_load": ["self", "layer_idx", "stream"],
    "save_kv_layer": ["self", "layer_idx", "stream"],
    "wait_for_save": ["self", "stream"],
    "get_finished": ["self", "finished_gen_req_ids", "started_loading_req_ids"],
}


def _classes() -> dict[str, ast.ClassDef]:
    tree = ast.parse(SOURCE.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@pytest.mark.parametrize(("name", "base", "api"), [
    ("TidekvConnectorScheduler", "KvCacheConnectorScheduler", SCHEDULER_API),
    ("TidekvConnectorWorker", "KvCacheConnectorWorker", WORKER_API),
])
def test_classes_implement_the_reference_api(name: str, base: str, api: dict[str, list[str]]) -> None:
    cls = _classes()[name]
    assert [b.id for b in cls.bases if isinstance(b, ast.Name)] == [base]
    methods = {f.name: [a.arg for a in f.args.args] for f in cls.body if isinstance(f, ast.FunctionDef)}
    for method, params in api.items():
        assert methods.get(method) == params, f"{name}.{method}: {methods.get(method)} (expected {params})"


def test_loads_inside_tensorrt_llm() -> None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        pytest.skip("tensorrt_llm is not installed (its wheel is not obtainable here): the connector cannot be "
                    "imported, only read")
    from tidekv_trtllm import connector

    assert issubclass(connector.TidekvConnectorScheduler, connector.KvCacheConnectorScheduler)
    assert issubclass(connector.TidekvConnectorWorker, connector.KvCacheConnectorWorker)
