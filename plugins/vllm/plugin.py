"""Entry point for ``vllm.general_plugins``: registers tidekv with vLLM's factories, in every
process vLLM starts (registering twice is a no-op):

- ``TidekvConnector`` with ``KVConnectorFactory``, so ``--kv-transfer-config
  '{"kv_connector": "TidekvConnector", ...}'`` needs no module path;
- the ``tidekv`` weight-transfer backend with ``WeightTransferEngineFactory``, so
  ``--weight-transfer-config '{"backend": "tidekv"}'`` works.
"""

from __future__ import annotations

CONNECTOR_NAME = "TidekvConnector"
WEIGHTS_BACKEND = "tidekv"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "tidekv_vllm.connector", CONNECTOR_NAME)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API: the worker extension still works
        return
    if WEIGHTS_BACKEND not in getattr(WeightTransferEngineFactory, "_registry", {}):
        WeightTransferEngineFactory.register_engine(WEIGHTS_BACKEND, "tidekv_vllm.weights", "TidekvWeightTransferEngine")
