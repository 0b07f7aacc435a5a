"""Entry point for ``vllm.general_plugins``: registers TidekvConnector with vLLM's factory, so
``--kv-transfer-config '{"kv_connector": "TidekvConnector", ...}'`` needs no module path.
vLLM calls this in every process; registering twice is a no-op.
"""

from __future__ import annotations

CONNECTOR_NAME = "TidekvConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME in registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "tidekv_vllm.connector", CONNECTOR_NAME)
