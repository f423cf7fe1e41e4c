"""Chapter 03's global KV pool as the engine's KV connector (vLLM's ``KVConnector`` shape).

Two halves, as in vLLM:

* :class:`KVConnectorWorker` lives in every rank's model runner. It owns a
  :class:`global_kv_pool.GlobalKVPool` whose keys carry the rank, so each tensor-parallel rank
  publishes and loads its own shard of the heads. It *loads* blocks into the paged KV cache
  before the forward that needs them, and *saves* the blocks a forward filled, after it.
* :class:`KVConnectorScheduler` lives beside the scheduler (chapter 04 calls it through its
  ``kv_connector`` hook). At admission, after the local prefix hits, it asks the pool how many
  more whole blocks of the prompt it holds (``get_num_new_matched_tokens``); the scheduler then
  allocates their blocks and parks the request in ``WAITING_FOR_REMOTE_KVS``
  (``update_state_after_alloc``); the engine hands the pending loads to the workers at the
  start of the next step and reports what arrived (``finish_remote_loads``). After each
  ``schedule()`` it lists the blocks this step's forward will fill, to be published.

A block is addressed by its chained hash (chapter 03), which covers its whole prefix, so one
key names one K/V content whichever instance computed it; every fetched block is checked
(token ids, shape, dtype, checksum) and a bad or missing one ends the load there: the rest is
computed, never used wrong.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from global_kv_pool import EmbeddedKVPool, GlobalKVPool, KVPoolBackend, MooncakeKVPool
from prefix_block_manager import PrefixCachingBlockManager
from scheduler import Request, SchedulerOutput
from vllm_from_scratch.config import EngineConfig, KVTransferConfig


@dataclass
class BlockTransfer:
    """Blocks of one request to move between the pool and the paged KV cache."""

    request_id: str
    block_hashes: list[bytes]
    block_token_ids: list[tuple[int, ...]]
    block_ids: list[int]


@dataclass
class KVConnectorStats:
    """What ``/metrics`` reports about the pool (counts of rank 0's shard): the scheduler side
    counts its queries, the worker its loads and saves."""

    query_tokens: int = 0
    hit_tokens: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    loaded_bytes: int = 0
    saved_bytes: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0


def pool_namespace(config: EngineConfig, tp_rank: int) -> str:
    """Keys that only a compatible instance can use: the model (its config.json), the K/V dtype,
    the block size, and this rank's shard of the heads."""
    with open(os.path.join(config.model_dir, "config.json"), "rb") as f:
        model = hashlib.sha256(f.read()).hexdigest()[:16]
    dtype = str(config.torch_dtype).removeprefix("torch.")
    return f"{model}-{dtype}-bs{config.kvcache_block_size}-tp{config.tensor_parallel_size}r{tp_rank}"


def make_backend(transfer: KVTransferConfig) -> KVPoolBackend:
    if transfer.kv_connector == "embedded":
        return EmbeddedKVPool(transfer.global_segment_size or 1 << 30)
    assert transfer.master_server_address and transfer.metadata_server, "KVTransferConfig requires both for mooncake"
    return MooncakeKVPool(
        transfer.master_server_address,
        transfer.metadata_server,
        global_segment_size=transfer.global_segment_size,
        protocol=transfer.protocol,
    )


class KVConnectorWorker:
    """A rank's side: loads into and saves from its paged KV cache through the pool."""

    def __init__(self, config: EngineConfig, tp_rank: int, kv_cache: torch.Tensor):
        assert config.kv_transfer is not None, "a worker is only made for an engine with a kv_transfer_config"
        self.transfer = config.kv_transfer
        self.pool = GlobalKVPool(
            make_backend(self.transfer), pool_namespace(config, tp_rank), config.kvcache_block_size
        )
        self.kv_cache = kv_cache
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.stats = KVConnectorStats()

    def load(self, transfers: list[BlockTransfer]) -> dict[str, int]:
        """Fetch each request's blocks; ``{request_id: blocks loaded}`` (a prefix of the asked)."""
        loaded = {}
        start = time.perf_counter()
        for t in transfers:
            n = self.pool.fetch(t.block_hashes, t.block_token_ids, self.kv_cache, t.block_ids)
            loaded[t.request_id] = n
            self.stats.loaded_blocks += n
            self.stats.loaded_bytes += n * self.block_bytes
            self.stats.load_failures += n < len(t.block_ids)
        self.stats.load_seconds += time.perf_counter() - start
        return loaded

    def save(self, transfers: list[BlockTransfer]) -> None:
        start = time.perf_counter()
        for t in transfers:
            n = self.pool.publish(t.block_hashes, t.block_token_ids, self.kv_cache, t.block_ids)
            self.stats.saved_blocks += n
            self.stats.saved_bytes += n * self.block_bytes
        self.stats.save_seconds += time.perf_counter() - start

    def query(self, block_hashes: list[bytes]) -> int:
        """Tokens of ``block_hashes``' leading blocks the pool holds (``GlobalKVPool.query``)."""
        return self.pool.query(block_hashes)

    def close(self) -> None:
        self.pool.backend.close()


@dataclass
class KVConnectorMetadata:
    """What one step asks of the workers, carried by its ``SchedulerOutput``."""

    saves: list[BlockTransfer] = field(default_factory=list)


class KVConnectorScheduler:
    """The scheduler's side: what the pool holds, what to load, what to publish.

    Args:
        transfer: the parsed ``kv_transfer_config``.
        block_manager: the prefix-caching block manager (its block hashes are the pool's keys).
        query_pool: how many tokens of some leading block hashes the pool holds
            (:meth:`KVConnectorWorker.query`, asked of rank 0's worker).
        worker_stats: rank 0's worker's counters of loads and saves.
    """

    def __init__(
        self,
        transfer: KVTransferConfig,
        block_manager: PrefixCachingBlockManager,
        query_pool: Callable[[list[bytes]], int],
        worker_stats: Callable[[], KVConnectorStats],
    ):
        self.transfer = transfer
        self.block_manager = block_manager
        self.query_pool = query_pool
        self.worker_stats = worker_stats
        self.block_size = block_manager.block_size
        self.query_tokens = 0  # prompt tokens asked about at admissions
        self.hit_tokens = 0  # of those, held by the pool
        self._pending: dict[str, tuple[Request, int]] = {}
        self._loading: set[bytes] = set()  # block hashes the pending loads bring in
        self._num_published: dict[str, int] = {}  # leading blocks of a request already offered

    @property
    def stats(self) -> KVConnectorStats:
        """The pool's counters: the queries made here, the loads and saves the worker made."""
        return replace(self.worker_stats(), query_tokens=self.query_tokens, hit_tokens=self.hit_tokens)

    # ---- chapter 04's KVConnector protocol ---------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        if not self.transfer.loads:
            return 0
        first = num_computed_tokens // self.block_size
        hashes = self.block_manager.block_hashes(request)[first : self.block_manager.max_hit_blocks(request)]
        if not hashes:
            return 0
        if not self._loading.isdisjoint(hashes):
            return None  # next step they are local prefix hits: one load, not one per request
        matched = self.query_pool(hashes)
        self.query_tokens += len(hashes) * self.block_size
        self.hit_tokens += matched
        return matched

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        self._pending[request.request_id] = (request, num_external_tokens)
        first = request.num_computed_tokens // self.block_size
        self._loading.update(self.block_manager.block_hashes(request)[first:][: num_external_tokens // self.block_size])

    def request_finished(self, request: Request) -> None:
        self._pending.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)

    # ---- the engine's side ------------------------------------------------------------------
    def take_pending_loads(self) -> list[BlockTransfer]:
        """The loads promised at the last admissions, as block transfers for the workers."""
        loads = []
        for req, num_tokens in self._pending.values():
            first = req.num_computed_tokens // self.block_size
            loads.append(self._transfer(req, first, first + num_tokens // self.block_size))
        self._pending = {}
        self._loading = set()
        return loads

    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata:
        """The blocks this step's forward fills with known tokens, to publish after it."""
        meta = KVConnectorMetadata()
        if not self.transfer.publishes:
            return meta
        for req in out.scheduled_requests:
            rid = req.request_id
            known = out.num_scheduled_tokens[rid] - len(out.scheduled_spec_decode_tokens.get(rid, ()))
            full = min((out.num_computed_tokens[rid] + known) // self.block_size, len(req.block_table))
            start = self._num_published.get(rid, 0)
            if full > start:
                meta.saves.append(self._transfer(req, start, full))
                self._num_published[rid] = full
        return meta

    def _transfer(self, req: Request, first: int, end: int) -> BlockTransfer:
        hashes = self.block_manager.block_hashes(req)
        return BlockTransfer(
            req.request_id,
            hashes[first:end],
            [tuple(req.block(i)) for i in range(first, end)],
            req.block_table[first:end],
        )
