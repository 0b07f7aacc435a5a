"""Entry point for ``vllm.general_plugins``: vLLM runs ``register()`` once in every process it
starts (API server, engine core, workers, or the one process of an offline ``LLM``), before
anything else of ours. It

- registers ``TidekvConnector`` with ``KVConnectorFactory``, so ``--kv-transfer-config
  '{"kv_connector": "TidekvConnector", ...}'`` needs no module path (registering twice is a no-op);
- registers the ``tidekv`` weight-transfer backend with ``WeightTransferEngineFactory``, so
  ``--weight-transfer-config '{"backend": "tidekv"}'`` works;
- sends tidekv's log records where vLLM sends its own (its handler and level), so that the
  connector's INFO lines (start-up, store link, released holds) appear in vLLM's log; nothing is
  changed when vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``) or ours is set up already;
- on a server's command line, checks ``--kv-transfer-config`` before the model loads
  (``command_line``): a bad ``kv_connector_extra_config`` or a misspelt connector name stops the
  server at once, the way argparse refuses a bad argument (the ``ConfigError``'s text on one line
  of stderr, exit status 2), since vLLM is building its argument parser when it calls us there.
"""

from __future__ import annotations

import logging
import os
import sys

from tidekv.errors import ConfigError
from tidekv_vllm.command_line import CONNECTOR_MODULE, CONNECTOR_NAME, check_command_line

WEIGHTS_BACKEND = "tidekv"
_OUR_LOGGERS = ("tidekv", "tidekv_vllm")

__all__ = ["CONNECTOR_NAME", "WEIGHTS_BACKEND", "register"]


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _join_vllm_log()
    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME not in registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API: the worker extension still works
        pass
    else:
        if WEIGHTS_BACKEND not in getattr(WeightTransferEngineFactory, "_registry", {}):
            WeightTransferEngineFactory.register_engine(WEIGHTS_BACKEND, "tidekv_vllm.weights",
                                                        "TidekvWeightTransferEngine")
    try:
        check_command_line(sys.argv, registered=set(registry))
    except ConfigError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: argument --kv-transfer-config: {exc}", file=sys.stderr,
              flush=True)
        raise SystemExit(2) from None


def _join_vllm_log() -> None:
    """tidekv's loggers write through vLLM's handlers at vLLM's level (vLLM configures only its
    own "vllm" logger, so our records would otherwise reach no handler below WARNING)."""
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    for name in _OUR_LOGGERS:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level)
        ours.propagate = False
