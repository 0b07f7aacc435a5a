"""Storage keys of HiCache pages: how a page hash becomes the keys of its objects in the store.

SGLang's cache controller hands the backend bare page hashes (64 hex digits, a SHA-256 chain
over the page's token ids). Like SGLang's own mooncake backend, every page is stored as one
object per KV component, named after the rank that holds that slice:

- MHA: ``[{prefix}_]{hash}_{tp_rank}[_{pp_rank}]_k`` and ``..._v`` (each rank holds its heads);
- MLA: ``[{prefix}_]{hash}_[{pp_rank}]_k`` (one latent per token, the same on every TP rank, so
  all ranks share one object - with no pipeline parallelism the rank part is empty: ``{hash}__k``);
- ``prefix`` is ``extra_backend_tag`` and the model name (``/`` -> ``-``), joined by ``_``;
- with attention context parallelism (``attn_cp_size > 1``, where each CP rank holds a disjoint
  slice of every page) ``_cp{attn_cp_rank}`` follows the pipeline rank. SGLang's mooncake backend
  has no such part; without it CP ranks would overwrite each other's slices.

Decode-context-parallel sharding (``dcp_size > 1``) and heterogeneous-TP head splitting
(``tp_lcm_size``) are not supported by this backend and are refused when it is created.
Neighbours: ``hicache`` maps each key to its address in SGLang's host pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidekv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PageKeys:
    """Key scheme of one rank: ``keys(hashes)`` lists ``per_page`` keys per page hash, page by page."""

    prefix: str
    """Prefix before the hash (``""`` for none)."""
    suffixes: tuple[str, ...]
    """What follows the hash, one per object of a page, in host-pool buffer order (k, then v)."""

    @classmethod
    def for_rank(cls, storage_config: Any, extra_backend_tag: str | None = None) -> PageKeys:
        """The scheme of the rank ``storage_config`` (a ``HiCacheStorageConfig``) describes.

        Raises:
            ConfigError: a parallel layout this backend does not support (DCP, split heads).
        """
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise ConfigError(f"dcp_size={storage_config.dcp_size}: decode context parallelism is not supported by "
                              "the tidekv HiCache backend; run without DCP or use another backend")
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError("tp_lcm_size (heterogeneous TP head splitting) is not supported by the tidekv HiCache "
                              "backend; remove tp_lcm_size from the extra config")
        parts = [extra_backend_tag] if extra_backend_tag else []
        if storage_config.model_name:
            parts.append("-".join(str(storage_config.model_name).split("/")))
        prefix = "_".join(parts)
        rank = [] if storage_config.is_mla_model else [str(storage_config.tp_rank)]
        if storage_config.pp_size > 1:
            rank.append(str(storage_config.pp_rank))
        if storage_config.attn_cp_size > 1:
            rank.append(f"cp{storage_config.attn_cp_rank}")
        rank_part = "_".join(rank)
        components = ("k",) if storage_config.is_mla_model else ("k", "v")
        return cls(prefix, tuple(f"_{rank_part}_{c}" for c in components))

    @property
    def per_page(self) -> int:
        """Objects per page: 2 for MHA (k, v), 1 for MLA."""
        return len(self.suffixes)

    def keys(self, page_hashes: Sequence[str]) -> list[str]:
        """The keys of each page's objects, ``per_page`` consecutive keys per page."""
        head = f"{self.prefix}_" if self.prefix else ""
        return [f"{head}{h}{s}" for h in page_hashes for s in self.suffixes]
