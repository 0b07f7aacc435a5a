"""RL weight updates for SGLang through tidekv, behind SGLang's own update API.

SGLang runs a *custom weight loader* named in ``update_weights_from_tensor(load_format=...)``
inside every TP worker, with the model and the (name, tensor) list it was given. tidekv's
loader takes a single request entry instead of real tensors -- the publisher's address and the
version, in the entry's name -- and pulls the version straight into the worker over the transfer engine, so the
bytes never pass through SGLang's scheduler pipes:

    # launch: python -m sglang.launch_server ... --custom-weight-loader tidekv_sglang.weights.load_from_tidekv
    from tidekv_sglang.weights import update_weights
    update_weights(engine, "10.0.0.1:5555", version=7)         # sglang.Engine (offline)
    # or over HTTP: POST /update_weights_from_tensor with update_request_payload(...)

A version is pulled completely before ``model.load_weights`` is called: a trainer that dies
mid-update fails the request and the engine keeps its weights.
"""

from __future__ import annotations

import base64
import io
import logging
import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tidekv.config import parse_host_port
from tidekv.errors import ConfigError
from tidekv.weights import Subscriber

logger = logging.getLogger(__name__)

LOADER = "tidekv_sglang.weights.load_from_tidekv"
"""The value of ``--custom-weight-loader`` and of ``load_format``."""

_SCHEME = "tidekv"
_subscribers: dict[str, Subscriber] = {}  # one per publisher, per worker process
_lock = threading.Lock()


@dataclass(frozen=True)
class UpdateRequest:
    """Which version to pull from where. It travels through SGLang as the *name* of a single
    empty tensor (``tidekv://host:port?version=N&wait_s=S``): SGLang's safe unpickler admits
    tensors only, and an empty CPU tensor pickles by value."""

    publisher: str
    version: int | None = None
    wait_s: float = 60.0

    def __post_init__(self) -> None:
        parse_host_port(self.publisher, "publisher")
        if self.version is not None and not isinstance(self.version, int):
            raise ConfigError(f"version {self.version!r} must be an int or None")

    @property
    def name(self) -> str:
        query = f"wait_s={self.wait_s}" + ("" if self.version is None else f"&version={self.version}")
        return f"{_SCHEME}://{self.publisher}?{query}"

    @classmethod
    def parse(cls, name: str) -> UpdateRequest:
        """The request a tensor name carries.

        Raises:
            ConfigError: the name is not a tidekv update request.
        """
        parts = urlsplit(name)
        if parts.scheme != _SCHEME or not parts.netloc:
            raise ConfigError(f"{name!r} is not a tidekv weight-update request (want {_SCHEME}://host:port?version=N)")
        query = parse_qs(parts.query)
        try:
            version = int(query["version"][0]) if "version" in query else None
            wait_s = float(query.get("wait_s", ["60"])[0])
        except ValueError:
            raise ConfigError(f"{name!r}: version must be an int and wait_s a number") from None
        return cls(parts.netloc, version, wait_s)


def request_entries(publisher: str, version: int | None = None, wait_s: float = 60.0) -> list[tuple[str, Any]]:
    """The ``named_tensors`` argument that asks the tidekv loader for ``version``."""
    import torch

    return [(UpdateRequest(publisher, version, wait_s).name, torch.empty(0))]


def load_from_tidekv(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang custom weight loader: pulls the requested version and loads it into ``model``.

    Raises:
        ConfigError: ``named_tensors`` is not exactly one tidekv request.
        PublisherUnavailableError, VersionNotFoundError, VersionChangedError: the pull failed
            (the model is untouched).
    """
    if len(named_tensors) != 1:
        raise ConfigError(f"the tidekv loader takes one request entry (see request_entries), got {len(named_tensors)} tensors")
    request = UpdateRequest.parse(named_tensors[0][0])
    with _lock:
        sub = _subscribers.get(request.publisher)
        if sub is None:
            sub = _subscribers[request.publisher] = Subscriber(request.publisher)
    pulled = sub.pull(request.version, wait_s=request.wait_s)
    model.load_weights(list(pulled))
    logger.info("loaded weights version %d from %s (%.1f MiB in %.3f s)", pulled.version, request.publisher,
                pulled.nbytes / 2**20, pulled.seconds)


def update_weights(engine: Any, publisher: str, version: int | None = None, *, wait_s: float = 60.0,
                   flush_cache: bool = True) -> Any:
    """Updates an offline ``sglang.Engine`` (launched with ``custom_weight_loader=[LOADER]``)."""
    return engine.update_weights_from_tensor(request_entries(publisher, version, wait_s), load_format=LOADER,
                                             flush_cache=flush_cache)


def update_request_payload(publisher: str, version: int | None = None, *, wait_s: float = 60.0,
                           tp_size: int = 1, flush_cache: bool = True) -> dict[str, Any]:
    """JSON body for ``POST /update_weights_from_tensor`` on an SGLang server."""
    import torch
    from torch.multiprocessing import reductions

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    # SGLang's monkey_patch_torch_reductions (if this process applied it) handles CUDA tensors only
    pickler.dispatch_table[torch.Tensor] = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    pickler.dump(request_entries(publisher, version, wait_s))
    encoded = base64.b64encode(buf.getvalue()).decode()
    return {"serialized_named_tensors": [encoded] * tp_size, "load_format": LOADER, "flush_cache": flush_cache}
