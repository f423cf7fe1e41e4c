"""Run the model on one scheduled batch: inputs in, one (or k+1) sampled token per request out.

A scheduler step hands over requests and how many tokens each gets. For request ``r`` with
``n`` scheduled tokens, those are ``r.token_ids[r.num_computed_tokens : +n]`` (followed by its
speculative drafts when it is verifying them); they occupy positions
``num_computed_tokens .. num_computed_tokens + n - 1``. A whole prompt, a chunk of one, a
single decode token and ``1 + k`` draft-verification tokens are the same thing here, so one
forward serves any mix of them (vLLM V1's design, chapter 06).

Everything per token is built with tensor ops (``repeat_interleave``, chapter 01's
``build_slot_mapping``); Python loops run once per *request*.

Sampling rows: a request produces a token only when its scheduled tokens reach the end of its
known tokens (a mid-prompt chunk does not), so logits are computed for those rows alone — the
LM head over 49k vocabulary entries is not paid for every prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kv_cache import allocate_kv_cache, build_slot_mapping, bytes_per_block, num_blocks_for_budget
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.cuda_graph import CUDAGraphRunner
from vllm_from_scratch.layers.attention import Attention, AttentionMetadata
from vllm_from_scratch.layers.prepacked import prepack_model
from vllm_from_scratch.loader import get_model
from vllm_from_scratch.sampler import Sampler


@dataclass
class ModelInput:
    """One batch, ready for ``model.forward`` and the sampler."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that sample
    num_sample_rows: list[int]  # per request: 0 (mid-prefill), 1, or 1 + number of drafts


class ModelRunner:
    """Owns the model weights, the KV cache and the sampler of one (tensor-parallel) rank.

    Args:
        config: the engine's settings.
        tp_rank / tp_group: this rank and its process group when ``tensor_parallel_size > 1``.
    """

    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_group=None):
        self.config = config
        self.device = config.torch_device
        if self.device.type == "cuda" and config.tensor_parallel_size > 1:
            self.device = torch.device("cuda", tp_rank)  # rank r owns GPU r, whatever "cuda:N" said
        self.block_size = config.kvcache_block_size
        self.tp_group = tp_group
        self.model = get_model(config.model_dir, config.torch_dtype, self.device, tp_rank,
                               config.tensor_parallel_size, tp_group, config=config.hf_config)
        prepack_model(self.model)  # on a CPU: weights packed once for oneDNN (layers/prepacked.py)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler()
        self.kv_cache = None
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.graph_runner = self.capture_cudagraph() if self.device.type == "cuda" and not config.enforce_eager else None

    def capture_cudagraph(self) -> CUDAGraphRunner:
        """Capture decode CUDA graphs (``cuda_graph.py``); every rank captures its own."""
        cfg = self.config
        runner = CUDAGraphRunner(self.model, cfg.max_num_seqs, cfg.max_model_len, self.block_size,
                                 cfg.hf_config.hidden_size, cfg.torch_dtype, self.device)
        runner.capture()
        return runner

    # ------------------------------------------------------------------ KV cache
    def _block_bytes(self) -> int:
        layer = self.attn_layers[0]
        return bytes_per_block(len(self.attn_layers), self.block_size, layer.num_kv_heads, layer.head_dim,
                               self.config.torch_dtype)

    def _num_blocks_from_memory(self) -> int:
        cfg = self.config
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            # Keep (1 - utilization) of the card free, plus headroom for activations of a full batch.
            hidden = self.model.config.hidden_size
            activations = cfg.max_num_batched_tokens * hidden * 4 * 16
            budget = int(total * cfg.gpu_memory_utilization) - used_by_others - activations
        else:
            budget = int(cfg.cpu_kvcache_space_gib * 2**30)
        layer = self.attn_layers[0]
        num = num_blocks_for_budget(max(budget, 0), len(self.attn_layers), self.block_size, layer.num_kv_heads,
                                    layer.head_dim, cfg.torch_dtype)
        # More blocks than max_num_seqs full-length requests can ever hold would be wasted memory.
        cap = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size)
        return min(num, cap)

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
            raise ValueError(f"no room for a single KV block ({self._block_bytes()} bytes); lower max_num_batched_tokens "
                             "or raise gpu_memory_utilization / cpu_kvcache_space_gib")
        layer = self.attn_layers[0]
        self.kv_cache = allocate_kv_cache(len(self.attn_layers), num_blocks, self.block_size, layer.num_kv_heads,
                                          layer.head_dim, self.config.torch_dtype, self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def get_num_kvcache_blocks(self) -> int:
        return self.num_kvcache_blocks

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, requests: list, num_scheduled_tokens: list[int]) -> ModelInput:
        """Flatten the scheduled tokens of every request into one batch (see the module doc)."""
        starts, token_chunks, block_tables, num_sample_rows = [], [], [], []
        for req, n in zip(requests, num_scheduled_tokens):
            start = req.num_computed_tokens
            known = req.num_tokens
            chunk = req.token_ids[start:min(start + n, known)]
            drafts = getattr(req, "spec_token_ids", None) or []
            if start + n > known:
                chunk = chunk + drafts[: start + n - known]
            token_chunks.append(chunk)
            starts.append(start)
            block_tables.append(req.block_table)
            num_sample_rows.append(start + n - known + 1 if start + n >= known else 0)
        dev = self.device
        lens = torch.tensor(num_scheduled_tokens, dtype=torch.int32)
        starts_t = torch.tensor(starts, dtype=torch.int32)
        cu_seqlens_q = torch.zeros(len(requests) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu_seqlens_q[1:])
        total = int(cu_seqlens_q[-1])
        seq_ids = torch.repeat_interleave(torch.arange(len(requests)), lens)
        positions = torch.arange(total) - cu_seqlens_q[:-1][seq_ids] + starts_t[seq_ids]
        width = max(len(bt) for bt in block_tables)
        bt_tensor = torch.tensor([bt + [0] * (width - len(bt)) for bt in block_tables], dtype=torch.int32)
        slot_mapping = build_slot_mapping(bt_tensor, positions, self.block_size, seq_ids)
        seq_lens_k = starts_t + lens
        ends = cu_seqlens_q[1:].tolist()
        logits_indices = [i for end, k in zip(ends, num_sample_rows) for i in range(end - k, end)]
        input_ids = torch.tensor([t for chunk in token_chunks for t in chunk], dtype=torch.long)
        md = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev, non_blocking=True),
            cu_seqlens_q=cu_seqlens_q.to(dev, non_blocking=True),
            seq_lens_k=seq_lens_k.to(dev, non_blocking=True),
            block_tables=bt_tensor.to(dev, non_blocking=True),
            max_seqlen_q=max(num_scheduled_tokens),
            max_seqlen_k=int(seq_lens_k.max()),
            is_decode=max(num_scheduled_tokens) == 1,
        )
        return ModelInput(input_ids.to(dev, non_blocking=True), positions.to(dev, non_blocking=True), md,
                          torch.tensor(logits_indices, dtype=torch.long, device=dev), num_sample_rows)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def compute_logits(self, requests: list, num_scheduled_tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Forward the batch; float32 logits of the sampling rows, and how many rows each request owns."""
        inp = self.prepare_inputs(requests, num_scheduled_tokens)
        if self.graph_runner is not None and self.graph_runner.can_run(inp.input_ids, inp.attn_metadata):
            hidden = self.graph_runner.run(inp.input_ids, inp.positions, inp.attn_metadata)
        else:
            hidden = self.model(inp.input_ids, inp.positions, inp.attn_metadata)
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        # Under tensor parallelism only rank 0 receives the gathered logits and samples.
        return (None if logits is None else logits.float()), inp.num_sample_rows

    @staticmethod
    def sampling_tensors(requests: list, rows: list[int], vocab_size: int, device) -> dict:
        """Per-row temperature / top-k / top-p tensors and generators (a request repeats over its rows)."""
        params = [(r.sampling_params, getattr(r, "generator", None)) for r, k in zip(requests, rows) for _ in range(k)]
        temps = torch.tensor([p.temperature for p, _ in params], dtype=torch.float32, device=device)
        top_ks = top_ps = None
        if any(p.top_k > 0 for p, _ in params):
            top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p, _ in params], device=device)
        if any(p.top_p < 1.0 for p, _ in params):
            top_ps = torch.tensor([p.top_p for p, _ in params], dtype=torch.float32, device=device)
        gens = [g for _, g in params]
        return dict(temperatures=temps, top_ks=top_ks, top_ps=top_ps, generators=gens if any(gens) else None)

    @torch.inference_mode()
    def execute_model(self, requests: list, num_scheduled_tokens: list[int]) -> dict[str, list[int]]:
        """Run one step without speculative drafts: ``{request_id: [next_token]}`` for requests
        whose scheduled tokens reached their end (mid-prompt chunks get ``[]``)."""
        logits, rows = self.compute_logits(requests, num_scheduled_tokens)
        out = {r.request_id: [] for r in requests}
        if logits is None or logits.shape[0] == 0:
            return out
        tokens = self.sampler(logits, **self.sampling_tensors(requests, rows, logits.shape[-1], logits.device)).tolist()
        sampled = iter(tokens)
        for r, k in zip(requests, rows):
            if k:
                out[r.request_id] = [next(sampled)]
        return out
