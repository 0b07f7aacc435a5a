"""tidekv's vLLM plugin: the ``TidekvConnector`` KV connector (PD disaggregation over the transfer
engine, store-backed prefix reuse). Adapters only: transfers and storage live in ``tidekv``."""
