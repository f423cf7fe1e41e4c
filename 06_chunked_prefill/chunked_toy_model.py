"""A small real transformer that runs mixed prefill/decode batches over the paged KV cache.

Random weights, but real layers and real matmuls (RMSNorm, rotary positions, grouped-query
attention, a SwiGLU MLP), so the cost of a forward grows with the tokens in it, and a bug in a
chunk's positions, slots or attention bounds changes its outputs. Each attention layer does what
the engine's does: chapter 01's ``store_kvcache`` writes this step's K/V into the slots the
block manager gave, then chapter 02's ``paged_attention_varlen`` attends, for every request at
once, from its new tokens to all of its cached ones through its block table.

:meth:`ToyTransformer.forward_dense` is the reference: plain causal attention over one whole
sequence, no cache. :class:`ToyRunner` is a minimal model runner: ``execute(scheduler_output)``
returns greedy tokens in the shape ``Scheduler.update_from_output`` takes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from chunked_prefill import BatchInputs, SchedulerInfo, build_batch_inputs
from kv_cache import allocate_kv_cache
from paged_attention import paged_attention_varlen
from scheduler import SchedulerOutput
from store_kvcache import store_kvcache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, heads, head_dim]`` at ``positions`` ``[T]`` (neox layout)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.float()[:, None] * inv_freq[None]
    cos, sin = angles.cos()[:, None].to(x.dtype), angles.sin()[:, None].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, intermediate: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden // num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        q, k, v = self.qkv(rms_norm(x, self.attn_norm)).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1
        )
        q = apply_rope(q.reshape(-1, self.num_heads, self.head_dim), positions)
        k = apply_rope(k.reshape(-1, self.num_kv_heads, self.head_dim), positions)
        return q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)

    def forward(self, x: torch.Tensor, inp: BatchInputs, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, inp.positions)
        md = inp.attn_metadata
        store_kvcache(k, v, k_cache, v_cache, md.slot_mapping)
        o = paged_attention_varlen(
            q, k_cache, v_cache, md.cu_seqlens_q, md.seq_lens_k, md.block_tables, self.scale, causal=True
        )
        return self._mlp(x + self.o_proj(o.reshape(x.shape[0], -1)))

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, torch.arange(x.shape[0], device=x.device))
        rep = self.num_heads // self.num_kv_heads
        o = nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(rep, 1).transpose(0, 1),
            v.repeat_interleave(rep, 1).transpose(0, 1),
            is_causal=True,
            scale=self.scale,
        )
        return self._mlp(x + self.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1)))


class ToyTransformer(nn.Module):
    """A decoder-only transformer with random weights (fixed by ``seed``)."""

    def __init__(
        self,
        vocab_size: int = 256,
        hidden: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate: int | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if hidden % num_heads or num_heads % num_kv_heads:
            raise ValueError("hidden must be a multiple of num_heads, num_heads of num_kv_heads")
        self.vocab_size, self.num_kv_heads, self.head_dim = vocab_size, num_kv_heads, hidden // num_heads
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(
            ToyLayer(hidden, num_heads, num_kv_heads, intermediate or 4 * hidden) for _ in range(num_layers)
        )
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        self.to(dtype)
        self.eval()

    @torch.inference_mode()
    def forward(self, inp: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(inp.logits_indices), vocab]`` of the sampling rows of a mixed batch."""
        x = self.embed(inp.input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, inp, kv_cache[0, i], kv_cache[1, i])
        return self.lm_head(rms_norm(x[inp.logits_indices], self.norm)).float()

    @torch.inference_mode()
    def forward_dense(self, token_ids: list[int]) -> torch.Tensor:
        """Reference logits ``[len(token_ids), vocab]`` of one sequence, without any cache."""
        x = self.embed(torch.tensor(token_ids, device=self.embed.weight.device))
        for layer in self.layers:
            assert isinstance(layer, ToyLayer)
            x = layer.forward_dense(x)
        return self.lm_head(rms_norm(x, self.norm)).float()


class ToyRunner:
    """Runs scheduler steps on a :class:`ToyTransformer` with a paged KV cache of its own.

    ``execute(out)`` builds :class:`SchedulerInfo` and the flat inputs, runs one forward and
    returns greedy tokens per sampling request (accepted drafts, then one more, as chapter 05's
    greedy verification would); ``last_logits`` keeps each sampling row's logits for tests.
    """

    def __init__(self, model: ToyTransformer, num_blocks: int, block_size: int):
        self.model, self.block_size = model, block_size
        dtype, device = model.embed.weight.dtype, model.embed.weight.device
        self.kv_cache = allocate_kv_cache(
            len(model.layers), num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype, device
        )
        self.last_logits: dict[str, torch.Tensor] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        if out.is_empty():
            return {}
        info = SchedulerInfo.from_scheduler_output(out)
        inp = build_batch_inputs(info, self.block_size, self.kv_cache.device)
        logits = self.model(inp, self.kv_cache)
        greedy = logits.argmax(-1).tolist()
        sampled, row = {}, 0
        self.last_logits = {}
        for rid, chunk, last, k in zip(info.ids, info.chunk_prompts, info.last_pos, info.num_spec):
            if last < 0:
                continue
            drafts = chunk[len(chunk) - k :]
            tokens = []
            for j in range(k + 1):
                tokens.append(greedy[row + j])
                if j == k or drafts[j] != greedy[row + j]:
                    break
            sampled[rid] = tokens
            self.last_logits[rid] = logits[row : row + k + 1]
            row += k + 1
        return sampled
