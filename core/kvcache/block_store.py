"""The workers' half of store-backed prefix reuse: moving one tensor-parallel rank's slice of
blocks between its registered KV cache and the store, one store object per block (its runs,
``layout.block_spans``, gathered on a put and scattered on a get: no copy), in one batched call
each way.

Used by every engine plugin's worker for the ``BlockJob``s its scheduler planned
(``prefix_reuse``). Failures are typed and returned or raised for the plugin to report through
its engine's channel (vLLM: failed block ids; TensorRT-LLM: nothing to report, the blocks are
recomputed). Neighbours: ``layout`` (the spans of a block), ``prefix_reuse`` (the jobs),
``tidekv.store.Store`` (``get_many_into`` / ``put_many_from``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tidekv.kvcache.layout import KVLayout
from tidekv.kvcache.prefix_reuse import BlockJob


def load_blocks(store: Any, layout: KVLayout, tp_rank: int, jobs: Sequence[BlockJob]) -> set[int]:
    """Reads every block of ``jobs`` (rank ``tp_rank``'s keys) into its place in the KV cache.

    Returns:
        The blocks that are not in the store (whole): evicted since the scheduler looked, or this
        rank's client sees another pool. Their bytes must not be used.

    Raises:
        TidekvError: the store failed as a whole (nothing can be trusted of this call).
    """
    keys, parts, owners = [], [], []
    for job in jobs:
        for block, key in zip(job.blocks, job.keys[tp_rank]):
            keys.append(key)
            parts.append(layout.block_spans(block))
            owners.append(block)
    if not keys:
        return set()
    sizes = store.get_many_into(keys, parts)
    return {block for block, size in zip(owners, sizes) if size != layout.block_bytes}


def save_blocks(store: Any, layout: KVLayout, tp_rank: int, job: BlockJob) -> None:
    """Writes every block of ``job`` (rank ``tp_rank``'s keys) from the KV cache to the store.

    Raises:
        TidekvError: the store refused or failed (the blocks are recomputed some day).
    """
    if job.blocks:
        store.put_many_from(list(job.keys[tp_rank]), [layout.block_spans(block) for block in job.blocks])


class SaveQueue:
    """Block saves of one worker, run in order on one background thread, and the bookkeeping of
    which finished requests they still keep alive: an engine frees a finished request's blocks
    only once every save planned for it ended (reported exactly once by ``finished``).

    Not thread-safe: the worker's step thread calls it (the saves themselves run on the queue's
    thread). Neighbours: the plugins' workers (vLLM's also holds blocks for PD decodes).
    """

    def __init__(self, thread_name: str = "tidekv-save") -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._saves: dict[str, list[Any]] = {}  # request -> its save futures
        self._finished: set[str] = set()  # finished requests whose saves are still running

    def submit(self, request_id: str, fn: Any, *args: Any) -> None:
        """Runs ``fn(*args)`` after the saves submitted before it; it counts as the request's."""
        self._saves.setdefault(request_id, []).append(self._executor.submit(fn, *args))

    def mark_saved(self, request_id: str) -> None:
        """Counts a save the request was planned that needs no work (no store to save to)."""
        from concurrent.futures import Future

        done: Future[None] = Future()
        done.set_result(None)
        self._saves.setdefault(request_id, []).append(done)

    def is_waiting(self, request_id: str) -> bool:
        """Whether the request finished and its saves still run (``finished`` reports it later)."""
        return request_id in self._finished

    def wait(self, request_id: str) -> None:
        """Blocks until the request's saves ended (its blocks are about to be reused: preemption)."""
        for fut in self._saves.pop(request_id, []):
            fut.result()

    def finished(self, finished_ids: set[str]) -> set[str]:
        """Of the requests finished now (``finished_ids``) or earlier, those whose saves all
        ended since; each is returned once. Finished requests without saves are not returned."""
        self._finished |= {r for r in finished_ids if r in self._saves}
        done = {r for r in self._finished if all(f.done() for f in self._saves.get(r, []))}
        for rid in done:
            self._saves.pop(rid, None)
        self._finished -= done
        return done

    def shutdown(self) -> None:
        """Waits for the saves queued, then stops the thread."""
        self._executor.shutdown(wait=True)
