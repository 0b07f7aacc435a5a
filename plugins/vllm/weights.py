"""RL weight updates for vLLM through tidekv: the trainer publishes with
``tidekv.weights.Publisher``; each vLLM worker pulls with a ``Subscriber`` and loads.

Two ways in, one data path:

- the native weight-transfer API: start vLLM with ``weight_transfer_config={"backend": "tidekv"}``
  (registered by the general plugin), then ``init_weight_transfer_engine({"init_info":
  {"publisher": "host:port"}})``, ``start_weight_update()``, ``update_weights({"update_info":
  {"version": N}})``, ``finish_weight_update()`` -- or the HTTP routes of the same names;
- a worker extension for ``collective_rpc`` flows: ``worker_extension_cls=
  "tidekv_vllm.weights.TidekvWorkerExtension"``, then
  ``llm.collective_rpc("tidekv_update_weights", args=("host:port", N))``.

``update_weights(llm, publisher, version)`` does the whole native sequence for an offline ``LLM``
and resets the prefix cache (KV computed with the old weights must not be reused).

A version is pulled completely and checked before the model is touched: if the trainer dies
mid-update the pull fails and the engine keeps serving the old weights. Loading goes through
vLLM's layerwise reload (needed on CPU, where linear weights are repacked after loading).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tidekv.weights import PulledWeights, Subscriber

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

logger = logging.getLogger(__name__)


@dataclass
class TidekvWeightTransferInitInfo(WeightTransferInitInfo):
    publisher: str
    """The trainer's ``Publisher.address``, "host:port"."""
    host: str | None = None
    """Address this worker's transfer engine listens on (other receivers may read from it).
    Default ``$TIDEKV_HOST``, else the local address that routes to the publisher."""


@dataclass
class TidekvWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    version: int | None = None
    """Version to load; None = the latest published."""
    wait_s: float = 60.0
    """How long to wait for ``version`` to be published (the pull streams while it is)."""


def load_pulled(model: Any, model_config: Any, pulled: PulledWeights) -> None:
    """Loads a complete pulled version into ``model`` (checkpoint-format names)."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        model.load_weights(weights=iter(pulled))
    finally:
        finalize_layerwise_reload(model, model_config)
    logger.info("loaded weights version %d (%.1f MiB, pulled in %.3f s)", pulled.version, pulled.nbytes / 2**20, pulled.seconds)


class TidekvWeightTransferEngine(WeightTransferEngine[TidekvWeightTransferInitInfo, TidekvWeightTransferUpdateInfo]):
    """vLLM ``WeightTransferEngine`` backend "tidekv" (worker side)."""

    init_info_cls = TidekvWeightTransferInitInfo
    update_info_cls = TidekvWeightTransferUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._subscriber: Subscriber | None = None
        self.version: int | None = None

    def init_transfer_engine(self, init_info: TidekvWeightTransferInitInfo) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
        self._subscriber = Subscriber(init_info.publisher, host=init_info.host)

    def start_weight_update(self) -> None:
        """Nothing to prepare: the model is only touched once a whole version is here."""

    def receive_weights(self, update_info: TidekvWeightTransferUpdateInfo) -> None:
        if self._subscriber is None:
            raise RuntimeError("tidekv weight transfer: call init_weight_transfer_engine first")
        pulled = self._subscriber.pull(update_info.version, wait_s=update_info.wait_s)
        load_pulled(self.model, self.model_config, pulled)
        self.version = pulled.version

    def finish_weight_update(self) -> None:
        """Nothing left to do: receive_weights loaded and finalized the version."""

    def shutdown(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None


class TidekvWorkerExtension:
    """Mixed into vLLM's worker with ``worker_extension_cls``; call through ``collective_rpc``."""

    def tidekv_update_weights(self, publisher: str, version: int | None = None, wait_s: float = 60.0) -> int:
        """Pulls ``version`` (None = latest) from ``publisher`` and loads it; returns the version."""
        sub: Subscriber | None = getattr(self, "_tidekv_subscriber", None)
        if sub is None or getattr(self, "_tidekv_publisher", None) != publisher:
            if sub is not None:
                sub.close()
            sub = Subscriber(publisher)
            self._tidekv_subscriber, self._tidekv_publisher = sub, publisher
        pulled = sub.pull(version, wait_s=wait_s)
        runner = self.model_runner  # type: ignore[attr-defined]
        load_pulled(runner.model, runner.model_config, pulled)
        return pulled.version


def update_weights(llm: Any, publisher: str, version: int | None = None, *, wait_s: float = 60.0) -> None:
    """Updates an offline ``vllm.LLM`` started with ``weight_transfer_config={"backend": "tidekv"}``
    to ``version`` of ``publisher``, then resets its prefix cache.

    On failure (trainer gone, version freed) the exception propagates and the engine keeps
    serving the weights it had.
    """
    if getattr(llm, "_tidekv_publisher", None) != publisher:
        llm.init_weight_transfer_engine({"init_info": {"publisher": publisher}})
        llm._tidekv_publisher = publisher
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version, "wait_s": wait_s}})
    llm.finish_weight_update(weight_version=None if version is None else str(version))
    llm.reset_prefix_cache()
