"""The rejection sampler as one Triton program per request.

Same algorithm, same inputs and same noise as :func:`spec_decode.rejection_sample`, so the two
agree token for token. Each program walks its K drafts (accept iff ``u * q(x) < p(x)``), then
streams the vocabulary in ``BLOCK_V`` chunks once, keeping a running argmax of both candidate
weights (residual ``max(p - q, 0)`` and plain ``p``) divided by the exponential noise, and the
residual's total mass, so the fallback for an empty residual costs no second pass.
Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from spec_decode import PLACEHOLDER_TOKEN_ID, RejectionNoise, sample_rejection_noise, validate_rejection_inputs
from triton_setup import tl, triton  # before any other triton import


@triton.jit
def _rejection_sample_kernel(
    out_ptr,  # [B, K+1] int64, pre-filled with -1
    draft_ids_ptr,  # [B, K] int64, -1 padded
    draft_probs_ptr,  # [B, K, V] float32
    target_probs_ptr,  # [B, K+1, V] float32
    num_draft_ptr,  # [B] int64: real drafts per request
    uniform_ptr,  # [B, K] float32
    expo_ptr,  # [B, V] float32
    V,
    K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft_ptr + b)
    num_acc = n * 0
    stopped = n * 0
    for j in range(K):
        tok = tl.load(draft_ids_ptr + b * K + j)
        live = (stopped == 0) & (j < n)
        safe_tok = tl.where(live, tok, 0)
        p = tl.load(target_probs_ptr + (b * (K + 1) + j) * V + safe_tok)
        q = tl.load(draft_probs_ptr + (b * K + j) * V + safe_tok)
        u = tl.load(uniform_ptr + b * K + j)
        acc = live & (u * q < p)
        tl.store(out_ptr + b * (K + 1) + j, tok, mask=acc)
        num_acc += acc.to(tl.int64)
        stopped = tl.where(acc, stopped, 1)

    rejected = num_acc < n
    # q is only read after a rejection, and then num_acc < n <= K is a valid draft row.
    q_row = tl.where(rejected, num_acc, 0)
    q_len = tl.where(rejected, V, 0)
    p_base = target_probs_ptr + (b * (K + 1) + num_acc) * V
    q_base = draft_probs_ptr + (b * K + q_row) * V
    offs = tl.arange(0, BLOCK_V)
    best_res = -1.0
    best_res_idx = n * 0
    best_p = -1.0
    best_p_idx = n * 0
    res_mass = 0.0
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        in_vocab = idx < V
        p = tl.load(p_base + idx, mask=in_vocab, other=0.0)
        q = tl.load(q_base + idx, mask=idx < q_len, other=0.0)
        e = tl.load(expo_ptr + b * V + idx, mask=in_vocab, other=1.0)
        res = tl.maximum(p - q, 0.0)
        res_mass += tl.sum(res, axis=0)
        # Out-of-vocab lanes score -1 so they never win; strict '>' keeps the first maximum,
        # the same tie rule as torch.argmax.
        score_res = tl.where(in_vocab, res / e, -1.0)
        score_p = tl.where(in_vocab, p / e, -1.0)
        m_res = tl.max(score_res, axis=0)
        m_p = tl.max(score_p, axis=0)
        i_res = tl.argmax(score_res, axis=0).to(tl.int64) + start
        i_p = tl.argmax(score_p, axis=0).to(tl.int64) + start
        best_res_idx = tl.where(m_res > best_res, i_res, best_res_idx)
        best_res = tl.maximum(m_res, best_res)
        best_p_idx = tl.where(m_p > best_p, i_p, best_p_idx)
        best_p = tl.maximum(m_p, best_p)
    use_res = rejected & (res_mass > 0)
    token = tl.where(use_res, best_res_idx, best_p_idx)
    tl.store(out_ptr + b * (K + 1) + num_acc, token)


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    noise: RejectionNoise | None = None,
    block_v: int = 1024,
) -> torch.Tensor:
    """Triton twin of :func:`spec_decode.rejection_sample` (same arguments, same result).

    ``block_v`` is the vocabulary chunk a program streams at a time (a power of two).
    """
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a positive power of two, got {block_v}")
    num_draft, draft_probs = validate_rejection_inputs(draft_token_ids, draft_probs, target_probs)
    B, K = draft_token_ids.shape
    V = target_probs.shape[2]
    device = target_probs.device
    if noise is None:
        noise = sample_rejection_noise(B, K, V, device, generator)
    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    if B == 0:
        return out
    # A [B, 0, V] tensor has no storage to point at; give the kernel one row it never reads.
    q = draft_probs.float().contiguous() if K else torch.zeros(B, 1, V, device=device)
    _rejection_sample_kernel[(B,)](
        out,
        draft_token_ids.contiguous(),
        q,
        target_probs.float().contiguous(),
        num_draft.long().contiguous(),
        noise.uniform.float().contiguous(),
        noise.exponential.float().contiguous(),
        V,
        K=K,
        BLOCK_V=min(block_v, triton.next_power_of_2(V)),
    )
    return out
