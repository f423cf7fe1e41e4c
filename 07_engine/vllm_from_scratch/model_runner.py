"""Run the model on one scheduled step: a :class:`scheduler.SchedulerOutput` in, one
:class:`ModelRunnerOutput` out.

Chapter 06 builds one forward's tensors from any mix of prompts, chunks, decode tokens and drafts
(its batch, chapter 02's ``AttentionMetadata`` included); logits are computed for the sampling
rows only, and the sampler (``sampler.py``), or with drafts chapter 05's rejection sampler
(``spec_decoding.py``), turns them into tokens (07_engine/README.md, "Model runner").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist

from block_manager import cdiv
from chunked_prefill import BatchInputs, SchedulerInfo, build_batch_inputs
from kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for_budget
from scheduler import Request, SchedulerOutput
from vllm_from_scratch.compilation import CompiledForward
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.cuda_graph import MAX_CAPTURE_SIZE, CUDAGraphRunner
from vllm_from_scratch.kv_connector import BlockTransfer, KVConnectorStats, KVConnectorWorker
from vllm_from_scratch.layers.attention import Attention
from vllm_from_scratch.layers.prepacked import prepack_model
from vllm_from_scratch.loader import get_model
from vllm_from_scratch.sampler import (
    EngineRandomStream,
    LogprobsLists,
    ProcessorEntries,
    Sampler,
    SamplingMetadata,
    gather_logprobs,
)
from vllm_from_scratch.sampling_params import SamplingParams
from vllm_from_scratch.spec_decoding import RejectionSampler
from vllm_from_scratch.structured_output import GrammarOutput, apply_grammar_bitmask
from vllm_from_scratch.vllm_env import bind_threads, thread_cores

# Longest dummy prompt of the warm-up; a step at the token budget is several of them.
WARM_UP_ROW = 256
# Prompt positions whose logits exist at once when scoring prompt_logprobs (~200 MB float32
# at a 200k vocabulary).
PROMPT_LOGITS_SLICE = 256


def kv_cache_budget(total: int, free: int, activation_peak: int, utilization: float, graph_pool: int = 0) -> int:
    """Bytes the KV cache may take on a GPU (nano-vllm's ``allocate_kv_cache``): the share
    ``utilization`` of the card's ``total``, less what is in use before the cache (``total - free``:
    weights, CUDA context, other processes), less the largest step's transient ``activation_peak``
    (activations, logits, sampler) and the decode graphs' ``graph_pool``, which both live beside
    the cache. Never negative: 0 means no block fits.
    """
    for name, value in (
        ("total", total),
        ("free", free),
        ("activation_peak", activation_peak),
        ("graph_pool", graph_pool),
    ):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int of bytes, got {value!r}")
    if free > total:
        raise ValueError(f"free ({free}) must not exceed total ({total})")
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return max(int(total * utilization) - (total - free) - activation_peak - graph_pool, 0)


class MemoryProbes(Protocol):
    """The allocator statistics the KV cache is sized from on a GPU (``torch.cuda``'s, read by
    :class:`CudaMemoryProbes`). Anything with these methods will do: the CPU tests pass a stand-in
    with chosen numbers, so that the sizing runs in CI through the runner's own constructor."""

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...

    def reset_peak_memory_stats(self) -> None: ...

    def memory_allocated(self) -> int: ...

    def max_memory_allocated(self) -> int: ...

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the card."""
        ...


class CudaMemoryProbes:
    """:class:`MemoryProbes` of one CUDA device, read from ``torch.cuda``."""

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)


@dataclass(frozen=True)
class GPUPlatform:
    """What a runner does on a GPU beyond placing its tensors there: it sizes the KV cache from
    the allocator's measurements (``memory``) and, unless ``enforce_eager``, replays decode steps
    from captured graphs (``cuda_graphs``; False captures stand-ins that replay eagerly,
    ``cuda_graph.py``). :meth:`for_device` gives the CUDA one; a CPU runner given a stand-in takes
    every GPU branch whose logic is not CUDA itself, which is how CI runs them."""

    memory: MemoryProbes
    cuda_graphs: bool = True

    @classmethod
    def for_device(cls, device: torch.device) -> GPUPlatform | None:
        """The platform of ``device``: CUDA's probes and graphs, None on a CPU."""
        return cls(CudaMemoryProbes(device)) if device.type == "cuda" else None


def _params(req: Request) -> SamplingParams:
    """The engine schedules its own requests (``EngineRequest``), which carry sampling settings."""
    return req.sampling_params  # type: ignore[attr-defined]


@dataclass
class ModelRunnerOutput:
    """What one step gives back (vLLM V1's ``ModelRunnerOutput``), by request id.

    ``sampled_token_ids``: every request that sampled gets one token, or, after ``k`` drafts,
    the accepted drafts followed by one recovered or bonus token; ``[NO_TOKEN]`` when its
    distribution had no token to draw (:func:`sampler.resolve_infinite_logits`). ``logprobs``:
    for those that asked, one position per token (:class:`sampler.LogprobsLists`).
    ``prompt_logprobs``: for a request that scores its prompt and fed prompt tokens this step,
    ``(first prompt position, positions)``. Ranks other than 0 return an empty one.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)


@dataclass
class PromptRows:
    """Where one request's prompt is scored this step: the hidden states at ``flat_rows`` (of
    the flat batch) predict prompt tokens ``first_position ...``, which are ``next_tokens``."""

    request_id: str
    first_position: int
    flat_rows: list[int]
    next_tokens: list[int]
    num_logprobs: int


class ModelRunner:
    """Owns the model weights, the KV cache and the sampler of one (tensor-parallel) rank:
    ``tp_rank`` in ``tp_group`` when ``config.tensor_parallel_size > 1``.

    ``gpu`` is the :class:`GPUPlatform` (default: the device's own, None on a CPU): with one, the
    KV cache is sized by profiling the largest steps and decode steps replay captured graphs;
    without, the cache is ``cpu_kvcache_space_gib`` and the forward is compiled by inductor.
    """

    def __init__(
        self,
        config: EngineConfig,
        tp_rank: int = 0,
        tp_group: dist.ProcessGroup | None = None,
        gpu: GPUPlatform | None = None,
    ):
        self.config = config
        self.device = config.torch_device
        if self.device.type == "cpu":
            bind_threads(thread_cores(tp_rank, config.tensor_parallel_size))
        if self.device.type == "cuda" and config.tensor_parallel_size > 1:
            self.device = torch.device("cuda", tp_rank)  # rank r owns GPU r, whatever "cuda:N" said
        self.gpu = gpu if gpu is not None else GPUPlatform.for_device(self.device)
        self.block_size = config.kvcache_block_size
        self.tp_group = tp_group
        self.model = get_model(
            config.model_dir,
            config.torch_dtype,
            self.device,
            tp_rank,
            config.tensor_parallel_size,
            tp_group,
            config=config.hf_config,
        )
        prepack_model(self.model)  # on a CPU: weights packed once for oneDNN (layers/prepacked.py)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for attn in self.attn_layers:
            attn.backend = config.attention_backend
        self.sampler = Sampler(config.vocab_size)
        self.random_stream = EngineRandomStream(config.seed, self.device)
        # A speculating engine samples every step through the rejection sampler (RejectionSampler.sample).
        self.rejection_sampler = RejectionSampler(self.device, config.vocab_size) if config.speculative else None
        # Each live request's logit_bias and min_tokens entries as tensors, built when it first
        # samples and dropped once the scheduler reports it finished (rank 0 samples).
        self.processor_entries: dict[str, ProcessorEntries] = {}
        # Sizing the cache on a GPU runs the largest steps through _forward, eagerly: the graphs
        # and the compiled forward are made after it, for the cache it sizes.
        self.graph_runner: CUDAGraphRunner | None = None
        self.compiled_forward: CompiledForward | None = None
        self.kv_cache: torch.Tensor  # [2, layers, blocks, block_size, kv_heads, head_dim], set by the next line
        self.memory_profile: dict[str, int] = {}  # what profile_gpu_memory measured (GPU, no num_kvcache_blocks)
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.kv_worker = KVConnectorWorker(config, tp_rank, self.kv_cache) if config.kv_transfer else None
        if self.gpu is not None and not config.enforce_eager:
            self.graph_runner = self.capture_cudagraph()
        if self.gpu is None and config.compiles:
            self.compiled_forward = CompiledForward.load_or_compile(config, self.model, self.kv_cache)

    def capture_cudagraph(self) -> CUDAGraphRunner:
        """Capture decode CUDA graphs (``cuda_graph.py``); every rank captures its own."""
        assert self.gpu is not None, "decode graphs are a GPU platform's"
        cfg = self.config
        runner = CUDAGraphRunner(
            self.model,
            cfg.max_num_seqs,
            cfg.max_model_len,
            self.block_size,
            cfg.hf_config.hidden_size,
            cfg.torch_dtype,
            self.device,
            use_cuda_graph=self.gpu.cuda_graphs,
        )
        runner.capture()
        return runner

    # ------------------------------------------------------------------ KV cache
    def _block_layout(self) -> tuple[int, int, int, int, torch.dtype]:
        """``(layers, block_size, kv_heads, head_dim, dtype)``, as chapter 01's KV cache functions take them."""
        layer = self.attn_layers[0]
        return len(self.attn_layers), self.block_size, layer.num_kv_heads, layer.head_dim, self.config.torch_dtype

    def _num_blocks_from_memory(self) -> int:
        cfg = self.config
        if self.gpu is not None:
            budget = self.profile_gpu_memory()["kv_budget"]
        else:
            # A CPU has no allocator statistics to measure a step's peak against; like vLLM's
            # VLLM_CPU_KVCACHE_SPACE, the cache gets a fixed size the user chooses.
            budget = int(cfg.cpu_kvcache_space_gib * 2**30)
        num = num_blocks_for_budget(budget, *self._block_layout())
        # More blocks than max_num_seqs full-length requests can ever hold would be wasted memory.
        cap = cfg.max_num_seqs * cdiv(cfg.max_model_len, self.block_size)
        return min(num, cap)

    @torch.inference_mode()
    def profile_gpu_memory(self) -> dict[str, int]:
        """Measure what the largest steps need beside the KV cache, as nano-vllm's
        ``warmup_model`` + ``allocate_kv_cache`` do, and size the cache from it.

        On a scratch cache of a few blocks (every row shares them: dummy K/V may collide), run
        the token budget as prompts of up to ``max_model_len`` tokens, then the most rows a step
        can sample through the logits and the sampler with top-k and top-p (the sort over
        ``[rows, vocab]`` float32 is the largest transient), recording the allocator's peak above
        the weights (``self.gpu.memory``). When decode graphs will be captured, a decode forward
        at the largest captured batch measures the graph pool too. Keeps and returns every number
        (``memory_profile``); ``kv_budget`` is :func:`kv_cache_budget` of them.

        The constructor calls it, before any graph exists: a captured graph holds the addresses
        of the cache this frees.
        """
        if self.gpu is None:
            raise RuntimeError("profile_gpu_memory needs a GPUPlatform: a CPU's cache is cpu_kvcache_space_gib")
        if self.graph_runner is not None or self.compiled_forward is not None:
            raise RuntimeError("profile_gpu_memory runs before the decode graphs are captured (they hold the cache)")
        memory, cfg = self.gpu.memory, self.config
        budget = cfg.max_num_batched_tokens
        longest = min(budget, cfg.max_model_len)
        prompts = [longest] * (budget // longest) + [budget % longest] * bool(budget % longest)
        k = cfg.speculative.num_speculative_tokens if cfg.speculative is not None else 0
        sample_rows = min(budget, cfg.max_num_seqs * (1 + k))
        layers, block_size, kv_heads, head_dim, dtype = self._block_layout()
        self._bind_kv_cache(
            allocate_kv_cache(layers, cdiv(longest, block_size), block_size, kv_heads, head_dim, dtype, self.device)
        )
        memory.synchronize()
        memory.empty_cache()
        memory.reset_peak_memory_stats()
        base = memory.memory_allocated()  # weights + the scratch cache
        self._dummy_forward(prompts, context=0, shared_blocks=True)
        logits = self._dummy_forward([1] * sample_rows, context=0, shared_blocks=True)
        if logits is not None:  # only rank 0 samples under tensor parallelism
            rows = torch.ones(sample_rows, device=self.device)
            self.sampler.draw(logits, rows, torch.full_like(rows, 50, dtype=torch.long), rows * 0.9)
            del logits
        memory.synchronize()
        activation_peak = memory.max_memory_allocated() - base
        graph_pool = 0
        if not cfg.enforce_eager:
            memory.reset_peak_memory_stats()
            self._dummy_forward([1] * min(cfg.max_num_seqs, MAX_CAPTURE_SIZE), 0, shared_blocks=True, logits=False)
            memory.synchronize()
            graph_pool = memory.max_memory_allocated() - base
        del self.kv_cache
        for attn in self.attn_layers:
            attn.k_cache = attn.v_cache = torch.empty(0, device=self.device)
        memory.empty_cache()
        free, total = memory.mem_get_info()
        self.memory_profile = {
            "total": total,
            "free": free,
            "weights_and_context": total - free,
            "activation_peak": activation_peak,
            "graph_pool": graph_pool,
            "kv_budget": kv_cache_budget(total, free, activation_peak, cfg.gpu_memory_utilization, graph_pool),
        }
        return self.memory_profile

    def allocate_kv_cache(self) -> int:
        """Allocate ``[2, layers, blocks, block_size, kv_heads, head_dim]`` and bind it to the layers."""
        num_blocks = self.config.num_kvcache_blocks or self._num_blocks_from_memory()
        if self.config.tensor_parallel_size > 1:
            # Rank 0's block manager hands out block ids valid on every rank: take the smallest
            # cache (GPUs differ in free memory). Before the check below, so all ranks raise alike.
            count = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.tp_group)
            num_blocks = int(count.item())
        if num_blocks < 1:
            raise ValueError(
                f"no room for a single KV block ({bytes_per_block(*self._block_layout())} bytes); "
                "lower max_num_batched_tokens or raise gpu_memory_utilization / cpu_kvcache_space_gib"
            )
        layers, block_size, kv_heads, head_dim, dtype = self._block_layout()
        self._bind_kv_cache(allocate_kv_cache(layers, num_blocks, block_size, kv_heads, head_dim, dtype, self.device))
        return num_blocks

    def _bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        for i, attn in enumerate(self.attn_layers):
            attn.bind_kv_cache(kv_cache, i)

    def get_num_kvcache_blocks(self) -> int:
        return self.num_kvcache_blocks

    @torch.inference_mode()
    def warm_up(self, prefill_lens: list[int], decode_batch_sizes: list[int]) -> None:
        """Run one prefill of each length and one decode step of each batch size on dummy tokens,
        so that the libraries' one-time work per shape (oneDNN builds a kernel for every new
        matmul shape) is done before the first real request. Call it before any request: the
        dummy K/V lands in blocks nobody holds yet, and every block is written before it is read.
        """
        for n in prefill_lens:
            # The linear layers see all n tokens as one matrix whatever the rows; rows of at most
            # WARM_UP_ROW tokens spare the warm-up a quadratic attention over one long prompt.
            rows = [WARM_UP_ROW] * (n // WARM_UP_ROW) + [n % WARM_UP_ROW] * bool(n % WARM_UP_ROW)
            self._dummy_forward(rows, context=0)
        for b in decode_batch_sizes:
            self._dummy_forward([1] * b, context=self.block_size - 1)

    def _dummy_forward(
        self, lens: list[int], context: int, shared_blocks: bool = False, logits: bool = True
    ) -> torch.Tensor | None:
        """Forward rows of ``lens`` dummy tokens after ``context`` cached ones; their logits.

        ``shared_blocks``: every row's table is the same first blocks (memory profiling, where
        the K/V written is never read back). ``logits=False`` stops at the hidden states, as a
        captured decode graph does. None when the cache cannot hold the shape (or no logits).
        """
        blocks_per_seq = cdiv(max(lens) + context, self.block_size)
        if blocks_per_seq * (1 if shared_blocks else len(lens)) > self.kv_cache.shape[2]:
            return None  # a cache this small never meets this shape
        info = SchedulerInfo()
        for i, n in enumerate(lens):
            first = 0 if shared_blocks else i * blocks_per_seq
            info.add_row(f"warm-up-{i}", [0] * n, context, list(range(first, first + blocks_per_seq)), samples=True)
        batch = build_batch_inputs(info, self.block_size, self.device)
        if not logits:
            self.model(batch.input_ids, batch.positions, batch.attn_metadata)
            return None
        return self.compute_logits(batch)

    # ------------------------------------------------------------------ forward
    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        """Hidden states of every token of ``batch`` (through a decode graph when one fits, through
        the compiled forward when there is one)."""
        md = batch.attn_metadata
        if self.graph_runner is not None and self.graph_runner.can_run(batch.input_ids, md):
            return self.graph_runner.run(batch.input_ids, batch.positions, md)
        if self.compiled_forward is not None:
            return self.compiled_forward.run(batch.input_ids, batch.positions, md, self.kv_cache)
        return self.model(batch.input_ids, batch.positions, md)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits of ``hidden``'s rows (None on ranks other than 0).

        Every rank must call it with the same rows: under tensor parallelism it gathers the
        vocabulary shards to rank 0, which alone samples.
        """
        logits = None if self.compiled_forward is None else self.compiled_forward.compute_logits(hidden)
        if logits is None:
            # Every registered model defines compute_logits (models/__init__.py); mypy sees a Module attribute.
            logits = self.model.compute_logits(hidden)  # type: ignore[operator]
        return None if logits is None else logits.float()

    @torch.inference_mode()
    def compute_logits(self, batch: BatchInputs) -> torch.Tensor | None:
        """Forward ``batch``; float32 logits of its sampling rows (None on ranks other than 0)."""
        return self._logits(self._forward(batch)[batch.logits_indices])

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run one scheduled step: the batch, one forward, the sampling rows' logits, the sampler.
        ``grammar_output``: the masks of the constrained requests, applied to their rows first
        (``structured_output.py``).

        Every rank runs the forward and the prompt rows' logits (collectives); rank 0 alone
        samples and returns what the step gave (:class:`ModelRunnerOutput`), the others an empty
        record. The K/V this forward filled is offered to the global KV pool after it.
        """
        info = SchedulerInfo.from_scheduler_output(scheduler_output)
        batch = build_batch_inputs(info, self.block_size, self.device)
        hidden = self._forward(batch)
        logits = self._logits(hidden[batch.logits_indices])
        prompt_logprobs = self._score_prompts(hidden, self._prompt_logprob_rows(scheduler_output, info))
        if self.kv_worker is not None and scheduler_output.kv_connector_metadata is not None:
            self.kv_worker.save(scheduler_output.kv_connector_metadata.saves)
        if logits is None or logits.shape[0] == 0:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        if grammar_output is not None:
            apply_grammar_bitmask(logits, grammar_output, info.ids, info.num_sample_rows)
        metadata = self._sampling_metadata(scheduler_output, info, logits)
        with self.random_stream.active():
            if self.rejection_sampler is None:
                sampled = self.sampler.sample(logits, metadata)
            else:
                drafts = [scheduler_output.scheduled_spec_decode_tokens.get(rid, []) for rid in metadata.request_ids]
                sampled = self.rejection_sampler.sample(logits, metadata, drafts)
        return ModelRunnerOutput(sampled.sampled_token_ids, sampled.logprobs, prompt_logprobs)

    def _sampling_metadata(
        self, scheduler_output: SchedulerOutput, info: SchedulerInfo, logits: torch.Tensor
    ) -> SamplingMetadata:
        """The sampling rows' settings; each request's processor entries are kept until the
        scheduler reports it finished."""
        for rid in scheduler_output.finished_request_ids:
            self.processor_entries.pop(rid, None)
        return SamplingMetadata.from_requests(
            scheduler_output.scheduled_requests,
            info.num_sample_rows,
            logits.shape[-1],
            logits.device,
            self.processor_entries,
        )

    @staticmethod
    def _prompt_logprob_rows(scheduler_output: SchedulerOutput, info: SchedulerInfo) -> list[PromptRows]:
        """The rows of each request in the batch that wants ``prompt_logprobs`` and feeds
        prompt tokens this step.

        The hidden state at position ``p`` predicts token ``p + 1``, so a chunk over positions
        ``[start, end)`` scores prompt tokens ``start + 1 ...`` up to the prompt's last one.
        Chunk by chunk, a long prompt is scored across steps (chunked prefill).
        """
        rows = []
        for i, req in enumerate(scheduler_output.scheduled_requests):
            k = _params(req).prompt_logprobs
            if k is None:
                continue
            start = info.kv_len[i]
            end = min(start + info.chunk_len[i], req.num_prompt_tokens - 1)
            if end > start:
                rows.append(
                    PromptRows(
                        req.request_id,
                        start + 1,
                        list(range(info.chunk_idx[i], info.chunk_idx[i] + end - start)),
                        req.prompt_token_ids[start + 1 : end + 1],
                        k,
                    )
                )
        return rows

    def _score_prompts(self, hidden: torch.Tensor, rows: list[PromptRows]) -> dict[str, tuple[int, LogprobsLists]]:
        """Every prompt row's logprobs, ``{request_id: (first position, positions)}`` (rank 0;
        every rank computes the logits with it, and gets ``{}``).

        The logits go through ``PROMPT_LOGITS_SLICE`` rows at a time: a whole chunk's
        ``[tokens, vocab]`` float32 logits would be gigabytes at a large token budget.
        """
        if not rows:
            return {}
        flat = [i for r in rows for i in r.flat_rows]
        targets = torch.tensor([t for r in rows for t in r.next_tokens], device=hidden.device)
        ks = [r.num_logprobs for r in rows for _ in r.next_tokens]
        lists = LogprobsLists([], [], [])
        for start in range(0, len(flat), PROMPT_LOGITS_SLICE):
            end = start + PROMPT_LOGITS_SLICE
            logits = self._logits(hidden[flat[start:end]])
            if logits is not None:
                part = gather_logprobs(logits.log_softmax(dim=-1), targets[start:end], ks[start:end])
                lists.token_ids += part.token_ids
                lists.logprobs += part.logprobs
                lists.ranks += part.ranks
        scored: dict[str, tuple[int, LogprobsLists]] = {}
        if not lists.token_ids:
            return scored  # a rank other than 0
        offset = 0
        for r in rows:
            end = offset + len(r.next_tokens)
            scored[r.request_id] = (
                r.first_position,
                LogprobsLists(lists.token_ids[offset:end], lists.logprobs[offset:end], lists.ranks[offset:end]),
            )
            offset = end
        return scored

    # ------------------------------------------------------------------ the global KV pool
    def query_kv_pool(self, block_hashes: list[bytes]) -> int:
        """Tokens of ``block_hashes``' leading blocks this rank's pool holds (rank 0 is asked)."""
        assert self.kv_worker is not None, "the engine only queries with a kv_transfer_config"
        return self.kv_worker.query(block_hashes)

    def kv_connector_stats(self) -> KVConnectorStats:
        """This rank's counters of loads and saves (a copy)."""
        assert self.kv_worker is not None, "the engine only asks with a kv_transfer_config"
        return replace(self.kv_worker.stats)

    def close_kv_pool(self) -> None:
        if self.kv_worker is not None:
            self.kv_worker.close()

    def load_kv(self, transfers: list[BlockTransfer]) -> dict[str, int]:
        """Load blocks from the global KV pool into this rank's cache; ``{request_id: tokens}``
        that every rank loaded (under tensor parallelism, the fewest any rank got)."""
        assert self.kv_worker is not None, "the engine only loads with a kv_transfer_config"
        loaded = self.kv_worker.load(transfers)
        if self.config.tensor_parallel_size > 1 and loaded:
            counts = torch.tensor([loaded[t.request_id] for t in transfers], device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=self.tp_group)
            loaded = dict(zip(loaded, counts.tolist()))
        return {rid: n * self.block_size for rid, n in loaded.items()}
