"""Speculative decoding: draft K tokens cheaply, verify them with one target forward.

The heart of the chapter is :func:`rejection_sample`, the modified rejection sampling of
Leviathan et al. (2023) that vLLM's rejection sampler implements: draft token ``x`` is accepted
with probability ``min(1, p(x) / q(x))``; at the first rejection a token is drawn from
``normalize(max(0, p - q))`` and the step stops; when all K drafts are accepted a bonus token is
drawn from the target's K+1-th distribution. Every emitted token then follows the target
distribution ``p`` exactly, whatever the draft distribution ``q`` was (README.md derives it).
Greedy decoding is the special case of one-hot ``p`` and ``q``.

Randomness is drawn up front (:func:`sample_rejection_noise`): one uniform per draft position
and one exponential vector per request. The recovered or bonus token is the exponential race
``argmax(w / E)`` with ``E ~ Exp(1)``, which samples index ``i`` with probability
``w_i / sum(w)`` without normalising ``w``. The torch and Triton versions consume the same noise
and so agree token for token.

Around the sampler: :func:`draft_generate`, :func:`verify_and_sample` and
:func:`speculative_decode_step` run one draft → verify → emit step on real models, and
:func:`rejection_sampling_batched` is greedy verification over vLLM's flattened layout (one
1-D tensor for the whole batch, ``cu_num_logits`` offsets per request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

PLACEHOLDER_TOKEN_ID = -1
# Probabilities are checked to sum to one within this tolerance (float32 softmax over a 50k
# vocabulary is off by ~1e-6; bfloat16 inputs are upcast before the check).
PROB_SUM_ATOL = 1e-3


# ─────────────────────────────────────────────────────────────────────────────────────────────
# Probabilities and validation
# ─────────────────────────────────────────────────────────────────────────────────────────────


def probs_from_logits(logits: torch.Tensor, temperature: float = 0.0) -> torch.Tensor:
    """Next-token distributions from logits: softmax(logits / T), or one-hot argmax when T == 0.

    Temperature zero (vLLM: below 1e-5) is greedy decoding; its distribution is the one-hot
    vector of the argmax, which turns the rejection sampler into exact-match verification.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    if temperature < 1e-5:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.softmax(logits / temperature, dim=-1)


def one_hot_draft_probs(draft_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q for a deterministic proposer (n-gram, greedy draft): 1 at the draft token, 0 elsewhere.

    Padding positions (``-1``) get an all-zero row; the samplers never read it.
    """
    probs = torch.zeros(*draft_token_ids.shape, vocab_size, device=draft_token_ids.device)
    valid = draft_token_ids >= 0
    probs.scatter_(-1, draft_token_ids.clamp(min=0).unsqueeze(-1), valid.unsqueeze(-1).float())
    return probs


def pad_draft_token_ids(drafts: Sequence[Sequence[int]], k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Ragged per-request drafts (each at most ``k`` long) as a ``[B, k]`` tensor padded with -1."""
    out = torch.full((len(drafts), k), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device="cpu")  # filled on the host
    for i, d in enumerate(drafts):
        if len(d) > k:
            raise ValueError(f"drafts[{i}] has {len(d)} tokens, more than k={k}")
        out[i, : len(d)] = torch.tensor(list(d), dtype=torch.long, device="cpu")
    return out.to(device)


def _check_distribution(name: str, probs: torch.Tensor, rows: torch.Tensor) -> None:
    """Raise ValueError unless every selected row of ``probs`` is a probability vector."""
    sel = probs[rows]
    if sel.numel() == 0:
        return
    if not torch.isfinite(sel).all() or (sel < 0).any():
        raise ValueError(f"{name} must be finite and non-negative")
    sums = sel.sum(-1)
    worst = (sums - 1).abs().max().item()
    if worst > PROB_SUM_ATOL:
        raise ValueError(f"{name} rows must sum to one (worst row is off by {worst:.3g})")


def validate_rejection_inputs(
    draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check shapes, token ids and distributions; return ``(num_draft_tokens [B], draft_probs)``.

    ``-1`` in ``draft_token_ids`` pads a request that has fewer than K drafts; it may only
    follow real drafts. ``draft_probs=None`` means deterministic drafts (one-hot q).
    """
    if draft_token_ids.dim() != 2 or draft_token_ids.dtype != torch.long:
        raise ValueError(
            f"draft_token_ids must be a [B, K] long tensor, got {tuple(draft_token_ids.shape)} {draft_token_ids.dtype}"
        )
    B, K = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (B, K + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    if V == 0:
        raise ValueError("target_probs must have a non-empty vocabulary dimension")
    if draft_probs is None:
        draft_probs = one_hot_draft_probs(draft_token_ids, V)
    elif draft_probs.shape != (B, K, V):
        raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, {V}], got {tuple(draft_probs.shape)}")
    valid = draft_token_ids >= 0
    if (draft_token_ids < PLACEHOLDER_TOKEN_ID).any() or (draft_token_ids >= V).any():
        raise ValueError(f"draft_token_ids must lie in [0, {V}) or be -1 (padding)")
    # A real draft after padding would make "the first K_i positions" ill-defined.
    if K > 1 and (valid[:, 1:] & ~valid[:, :-1]).any():
        raise ValueError("draft_token_ids: -1 padding may only follow the real drafts")
    num_draft = valid.sum(1)
    positions = torch.arange(K + 1, device=target_probs.device)
    _check_distribution("draft_probs", draft_probs.float(), valid)
    _check_distribution("target_probs", target_probs.float(), positions.unsqueeze(0) <= num_draft.unsqueeze(1))
    return num_draft, draft_probs


@dataclass
class RejectionNoise:
    """The random numbers one call of the rejection sampler consumes.

    uniform: ``[B, K]`` in [0, 1): draft ``x`` at position j is accepted iff ``u * q(x) < p(x)``,
        which happens with probability ``min(1, p(x) / q(x))``.
    exponential: ``[B, V]`` Exp(1) noise for the one recovered-or-bonus token per request.
    """

    uniform: torch.Tensor
    exponential: torch.Tensor


def sample_rejection_noise(
    batch_size: int,
    num_spec: int,
    vocab_size: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> RejectionNoise:
    """Draw the noise for one sampler call; the same generator state gives the same noise."""
    uniform = torch.rand(batch_size, num_spec, device=device, generator=generator)
    exponential = torch.empty(batch_size, vocab_size, device=device)
    exponential.exponential_(generator=generator)
    # Exp(1) can round to exactly 0 in float32; w / 0 would turn a zero-weight token into NaN.
    exponential.clamp_(min=torch.finfo(torch.float32).tiny)
    return RejectionNoise(uniform, exponential)


# ─────────────────────────────────────────────────────────────────────────────────────────────
# The probabilistic rejection sampler (torch)
# ─────────────────────────────────────────────────────────────────────────────────────────────


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    noise: RejectionNoise | None = None,
) -> torch.Tensor:
    """Verify K drafts per request so that the emitted tokens follow ``target_probs`` exactly.

    Args:
        draft_token_ids: ``[B, K]`` long; a request with fewer drafts pads with -1 at the end.
        draft_probs: ``[B, K, V]``, the distribution each draft was sampled from; ``None`` for
            deterministic drafts (one-hot, e.g. n-gram or greedy drafts).
        target_probs: ``[B, K+1, V]``, the target's distribution at each draft position plus the
            one after the last draft.
        generator: torch generator for reproducible sampling.
        noise: precomputed random numbers (overrides ``generator``); see
            :func:`sample_rejection_noise`.

    Returns:
        ``[B, K+1]`` long: the accepted drafts, then the recovered (after a rejection) or bonus
        (all accepted) token, then -1.
    """
    num_draft, draft_probs = validate_rejection_inputs(draft_token_ids, draft_probs, target_probs)
    B, K = draft_token_ids.shape
    V = target_probs.shape[2]
    p_all = target_probs.float()
    q_all = draft_probs.float()
    if noise is None:
        noise = sample_rejection_noise(B, K, V, target_probs.device, generator)

    ids = draft_token_ids.clamp(min=0).unsqueeze(-1)
    p = p_all[:, :K].gather(-1, ids).squeeze(-1)
    q = q_all.gather(-1, ids).squeeze(-1)
    live = draft_token_ids >= 0
    accepted = live & (noise.uniform * q < p)
    # Only the prefix before the first rejection counts.
    num_accepted = accepted.long().cumprod(1).sum(1)

    rows = torch.arange(B, device=target_probs.device)
    rejected = num_accepted < num_draft
    p_last = p_all[rows, num_accepted]
    q_last = q_all[rows, num_accepted.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_last)
    residual = torch.clamp(p_last - q_last, min=0)
    # p == q up to rounding can leave no residual mass; p itself is then the right fallback.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)
    weights = torch.where(rejected.unsqueeze(-1), residual, p_last)
    last_token = (weights / noise.exponential).argmax(-1)

    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=target_probs.device)
    positions = torch.arange(K + 1, device=target_probs.device).unsqueeze(0)
    keep = positions < num_accepted.unsqueeze(1)
    out[:, :K] = torch.where(keep[:, :K], draft_token_ids, out[:, :K])
    out[rows, num_accepted] = last_token
    return out


def num_accepted_tokens(output_token_ids: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per request from a sampler output: emitted tokens minus the last one."""
    return (output_token_ids >= 0).sum(1) - 1


# ─────────────────────────────────────────────────────────────────────────────────────────────
# Greedy verification over vLLM's flattened layout
# ─────────────────────────────────────────────────────────────────────────────────────────────


def rejection_sampling_batched(
    target_sampled: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_speculative_steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification over vLLM's flattened layout, vectorised: no loop over requests.

    Request r owns flat positions ``cu_num_logits[r] : cu_num_logits[r+1]`` (its drafts plus
    one). ``target_sampled[i]`` is the target's token at position i; ``draft_tokens`` is the
    input ids, so the draft checked against ``target_sampled[i]`` is ``draft_tokens[i + 1]``.
    This is exact-match verification: it keeps the target distribution only when the target
    tokens are greedy (or the drafts are one-hot, see :func:`rejection_sample`).

    Returns ``(sampled [num_reqs, num_speculative_steps + 1] with -1 padding, num_sampled)``.
    """
    if cu_num_logits.dim() != 1 or cu_num_logits.numel() < 1:
        raise ValueError("cu_num_logits must be a 1-D tensor of num_reqs + 1 offsets")
    if target_sampled.shape != draft_tokens.shape or target_sampled.dim() != 1:
        raise ValueError("target_sampled and draft_tokens must be 1-D tensors of equal length")
    counts = cu_num_logits[1:] - cu_num_logits[:-1]
    if (counts < 1).any() or (counts > num_speculative_steps + 1).any():
        raise ValueError(f"cu_num_logits: each request needs 1..{num_speculative_steps + 1} positions")
    if int(cu_num_logits[-1]) != target_sampled.numel():
        raise ValueError("cu_num_logits[-1] must equal len(target_sampled)")
    width = num_speculative_steps + 1
    starts = cu_num_logits[:-1].long()
    offs = torch.arange(width, device=target_sampled.device)
    idx = (starts.unsqueeze(1) + offs).clamp(max=target_sampled.numel() - 1)
    in_req = offs.unsqueeze(0) < counts.unsqueeze(1)
    target = target_sampled[idx]
    # The draft that position i verifies is the next input id; the last position has none.
    has_draft = offs.unsqueeze(0) < (counts - 1).unsqueeze(1)
    draft = draft_tokens[(idx + 1).clamp(max=target_sampled.numel() - 1)]
    match = has_draft & (target == draft)
    num_sampled = match.long().cumprod(1).sum(1) + 1
    keep = in_req & (offs.unsqueeze(0) < num_sampled.unsqueeze(1))
    sampled = torch.where(keep, target, torch.full_like(target, PLACEHOLDER_TOKEN_ID))
    return sampled, num_sampled.to(torch.int32)


# ─────────────────────────────────────────────────────────────────────────────────────────────
# One speculative step with real models: draft → verify → emit
# ─────────────────────────────────────────────────────────────────────────────────────────────


@runtime_checkable
class LogitsModel(Protocol):
    """What the step functions need from a model: next-token logits of the last positions."""

    def get_logits(self, token_ids: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """``[num_logits, V]`` logits predicting the token after each of the last positions."""


def draft_generate(
    draft_model: LogitsModel,
    context_ids: Sequence[int],
    num_speculative_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], torch.Tensor]:
    """The draft model proposes K tokens autoregressively; returns ``(tokens, probs [K, V])``.

    Each draft is *sampled from* the distribution returned for it (one-hot when greedy): the
    rejection sampler's guarantee needs the q it is given to be the q the draft came from.
    """
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    ids = list(context_ids)
    for _ in range(num_speculative_tokens):
        q = probs_from_logits(draft_model.get_logits(ids, 1)[-1], temperature)
        token = int(torch.multinomial(q, 1, generator=generator)) if temperature >= 1e-5 else int(q.argmax())
        tokens.append(token)
        probs.append(q)
        ids.append(token)
    vocab = probs[0].numel() if probs else 0
    return tokens, torch.stack(probs) if probs else torch.empty(0, vocab)


def verify_and_sample(
    target_model: LogitsModel,
    context_ids: Sequence[int],
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """One target forward over context + drafts, then rejection sampling.

    Returns ``(emitted_tokens, num_accepted)``: the accepted drafts followed by one recovered or
    bonus token, so ``len(emitted_tokens) == num_accepted + 1``: when every draft is accepted,
    the target's K+1-th distribution, already computed by the same forward, gives a bonus token.
    ``draft_probs`` (``[K, V]``, None for one-hot drafts) is where seed 000's listing passed
    ``temperature``; a number there is refused, so a call written for the listing fails loudly.
    """
    if draft_probs is not None and not isinstance(draft_probs, torch.Tensor):
        raise TypeError(f"draft_probs must be a [K, V] tensor or None, not {draft_probs!r}: pass temperature=...")
    k = len(draft_tokens)
    logits = target_model.get_logits(list(context_ids) + list(draft_tokens), k + 1)
    target_probs = probs_from_logits(logits, temperature).unsqueeze(0)
    draft_ids = torch.tensor([list(draft_tokens)], dtype=torch.long).reshape(1, k)
    q = None if draft_probs is None else draft_probs.reshape(1, k, -1).to(target_probs.device)
    out = rejection_sample(draft_ids.to(target_probs.device), q, target_probs, generator)[0]
    emitted = [int(t) for t in out if t >= 0]
    return emitted, len(emitted) - 1


class Proposer(Protocol):
    """Anything that proposes drafts for a batch: see ``proposers.py``."""

    def propose(self, token_ids_list: Sequence[Sequence[int]], k: int): ...


def speculative_decode_step(
    target_model: LogitsModel,
    draft_model: LogitsModel | Proposer,
    context_ids: Sequence[int],
    num_speculative_tokens: int = 5,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], dict]:
    """Draft, verify, emit: one target forward yields between 1 and K+1 tokens.

    ``draft_model`` is either a model with ``get_logits`` (drafts via :func:`draft_generate`) or
    a proposer with ``propose`` (e.g. ``NgramProposer``, whose drafts may be fewer than K).
    """
    q: torch.Tensor | None
    if isinstance(draft_model, LogitsModel):
        drafts, q = draft_generate(draft_model, context_ids, num_speculative_tokens, temperature, generator)
    else:
        proposal = draft_model.propose([list(context_ids)], num_speculative_tokens)
        if isinstance(proposal, tuple):  # a draft model: (drafts, q or None when greedy)
            drafts, probs = proposal[0][0], proposal[1]
            q = None if probs is None else probs[0, : len(drafts)]
        else:
            drafts, q = proposal[0], None
    tokens, num_accepted = verify_and_sample(target_model, context_ids, drafts, q, temperature, generator)
    stats = {
        "num_draft": len(drafts),
        "num_accepted": num_accepted,
        "acceptance_rate": num_accepted / len(drafts) if drafts else 0.0,
        "num_emitted": len(tokens),
    }
    return tokens, stats


@dataclass
class SpecDecodeStats:
    """Counters of a speculative generation (vLLM reports the same three)."""

    num_steps: int = 0  # target forwards
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_emitted_tokens(self) -> int:
        return self.num_accepted_tokens + self.num_steps

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0


def speculative_generate(
    target_model: LogitsModel,
    proposer: LogitsModel | Proposer | None,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    num_speculative_tokens: int = 4,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
) -> tuple[list[int], SpecDecodeStats]:
    """Generate up to ``max_new_tokens`` with :func:`speculative_decode_step`.

    ``proposer=None`` (or ``num_speculative_tokens=0``) is plain decoding through the very same
    code path, one target forward per token: the fair baseline for timing. Tokens emitted past
    ``max_new_tokens`` or after ``eos_token_id`` in a step are dropped.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    k = num_speculative_tokens if proposer is not None else 0
    draft_source = proposer if proposer is not None else _NoDrafts()
    ctx = list(prompt_ids)
    out: list[int] = []
    stats = SpecDecodeStats()
    while len(out) < max_new_tokens and (eos_token_id is None or eos_token_id not in out):
        tokens, step = speculative_decode_step(target_model, draft_source, ctx, k, temperature, generator)
        stats.num_steps += 1
        stats.num_draft_tokens += step["num_draft"]
        stats.num_accepted_tokens += step["num_accepted"]
        ctx += tokens
        out += tokens
    if eos_token_id is not None and eos_token_id in out:
        out = out[: out.index(eos_token_id) + 1]
    return out[:max_new_tokens], stats


class _NoDrafts:
    def propose(self, token_ids_list: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        return [[] for _ in token_ids_list]
