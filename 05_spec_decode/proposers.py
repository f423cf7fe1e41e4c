"""Who writes the drafts: an n-gram prompt lookup and a small draft model.

Both take a list of token-id lists (one per request) and ``k``:

* :class:`NgramProposer` returns ``list[list[int]]``, at most ``k`` drafts each (possibly none).
  Its drafts are deterministic, so their q is one-hot (``draft_probs=None`` in the samplers).
* :class:`DraftModelProposer` returns ``(drafts, draft_probs)``: a smaller causal LM drafts
  greedily (``draft_probs`` is None: q is one-hot) or by sampling at a temperature (the
  ``[B, k, V]`` q the drafts were drawn from). It asks its model for all requests at once,
  through :class:`BatchedLogitsModel`.

:class:`HFCausalLM` is such a model on transformers: a KV cache per key (a request id, say),
reused across calls by longest common prefix, so it only computes the tokens it has not seen;
after a verification step the cache is cropped back to the accepted prefix. It runs the rows
one after another; the engine (chapter 07) implements the same protocol on its paged KV cache
and runs them in one forward.
"""

from __future__ import annotations

import shutil
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from spec_decode import pad_draft_token_ids, probs_from_logits

if TYPE_CHECKING:
    from transformers import DynamicCache


class NgramProposer:
    """Prompt-lookup drafts: find the context's suffix earlier in the context, copy what followed.

    For n from ``max_n`` down to ``min_n`` the last n tokens are searched for in the rest of the
    context; the longest n that matches wins, and of its matches the most recent one (the
    likeliest to continue the same way). Up to ``k`` tokens that followed it are proposed.
    Free to run and often right on text that repeats its input (code edits, extraction, RAG).
    """

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n must be >= min_n ({min_n}), got {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose_one(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Drafts for one request: up to ``k`` tokens, [] when no suffix n-gram recurs."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        ids = np.asarray(token_ids, dtype=np.int64)
        L = ids.size
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # Candidate starts i end before the suffix itself starts, so a token follows each.
            windows = np.lib.stride_tricks.sliding_window_view(ids[: L - 1], n)
            hits = np.flatnonzero((windows == ids[L - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []

    def propose(self, token_ids_list: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Drafts for a batch: one list of at most ``k`` token ids per request."""
        return [self.propose_one(ids, k) for ids in token_ids_list]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0])


class BatchedLogitsModel(Protocol):
    """What :class:`DraftModelProposer` drafts with: next-token logits for many contexts at once.

    ``keys`` name a cache per context (e.g. request ids): a model may keep each context's K/V
    under its key and compute only what changed since the key's last call; ``release`` drops
    the caches of requests that ended.
    """

    vocab_size: int

    def get_logits_batch(self, token_ids_list: Sequence[Sequence[int]], keys: Sequence[Hashable]) -> torch.Tensor:
        """``[B, V]`` float32 logits predicting the token after each context's last position."""

    def release(self, keys: Sequence[Hashable]) -> None:
        """Forget the caches of ``keys``."""


class HFCausalLM:
    """A transformers causal LM that reuses its KV cache across calls (one cache per ``slot``).

    ``get_logits(ids, num_logits, slot)`` returns the next-token logits of the last
    ``num_logits`` positions of ``ids``. Tokens shared with the slot's previous call are not
    recomputed: the cache is cropped to the common prefix (a rejected draft's K/V is dropped
    exactly like vLLM rolls ``num_computed_tokens`` back) and only the new suffix is run. A slot
    is any hashable key. ``num_forwards`` and ``num_tokens_computed`` count the work done.
    """

    def __init__(self, model, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.vocab_size = self.model.config.vocab_size
        self._caches: dict[Hashable, tuple[DynamicCache | None, list[int]]] = {}
        self.num_forwards = 0
        self.num_tokens_computed = 0

    def reset(self) -> None:
        """Drop every slot's cache."""
        self._caches.clear()

    def release(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            self._caches.pop(key, None)

    @torch.inference_mode()
    def get_logits(self, token_ids: Sequence[int], num_logits: int = 1, slot: Hashable = 0) -> torch.Tensor:
        """``[num_logits, V]`` float32 logits predicting the token after each last position."""
        ids = list(token_ids)
        if not 1 <= num_logits <= len(ids):
            raise ValueError(f"num_logits must be in [1, len(token_ids)={len(ids)}], got {num_logits}")
        cache, cached_ids = self._caches.get(slot, (None, []))
        start = min(common_prefix_len(cached_ids, ids), len(ids) - num_logits)
        if cache is None or start == 0:
            cache = None
        else:
            cache.crop(start - cache.get_seq_length())
        inp = torch.tensor([ids[start:]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=inp, past_key_values=cache, use_cache=True, logits_to_keep=num_logits)
        self._caches[slot] = (out.past_key_values, ids)
        self.num_forwards += 1
        self.num_tokens_computed += len(ids) - start
        return out.logits[0, -num_logits:].float()

    def get_logits_batch(self, token_ids_list: Sequence[Sequence[int]], keys: Sequence[Hashable]) -> torch.Tensor:
        """The :class:`BatchedLogitsModel` call, one forward per row: each row has its own cache
        length, which a dense transformers cache cannot batch without padding."""
        return torch.stack([self.get_logits(ids, 1, slot=key)[0] for ids, key in zip(token_ids_list, keys)])


class DraftModelProposer:
    """Drafts from a smaller causal LM sharing the target's vocabulary.

    Args:
        model: an HF model directory, a transformers model, or a :class:`BatchedLogitsModel`
            (an :class:`HFCausalLM`, or the engine's paged draft model).
        temperature: 0 drafts greedily (q is one-hot, reported as None); above 0 drafts are
            *sampled* from softmax(logits / T), which is then q. Use the target's temperature:
            a draft identical to the target then has p == q and every draft is accepted.
        generator: torch generator for sampled drafts.
    """

    def __init__(
        self,
        model,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.lm = model if hasattr(model, "get_logits_batch") else HFCausalLM(model, device, dtype)
        self.temperature = temperature
        self.generator = generator

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def propose(
        self, token_ids_list: Sequence[Sequence[int]], k: int, keys: Sequence[Hashable] | None = None
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """``(drafts, draft_probs)``: k tokens per request and the ``[B, k, V]`` q they came from
        (None for greedy drafts).

        ``keys`` name each request's cache in the model; by default its row. Pass request ids
        when the batch changes between calls, so that a request keeps its cache wherever it
        sits, and :meth:`release` them when the requests end. One model call per draft position
        serves the whole batch.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        for i, ids in enumerate(token_ids_list):
            if not ids:
                raise ValueError(f"token_ids_list[{i}] is empty")
        keys = list(range(len(token_ids_list))) if keys is None else list(keys)
        if len(keys) != len(token_ids_list):
            raise ValueError(f"keys has {len(keys)} entries for {len(token_ids_list)} requests")
        contexts = [list(ids) for ids in token_ids_list]
        drafts: list[list[int]] = [[] for _ in contexts]
        probs = []
        for _ in range(k if contexts else 0):
            q = probs_from_logits(self.lm.get_logits_batch(contexts, keys), self.temperature)
            if self.greedy:
                tokens = q.argmax(-1)
            else:
                tokens = torch.multinomial(q, 1, generator=self.generator).squeeze(1)
                probs.append(q)
            for ctx, row, t in zip(contexts, drafts, tokens.tolist()):
                ctx.append(t)
                row.append(t)
        if self.greedy:
            return drafts, None
        if not probs:
            return drafts, torch.empty(len(contexts), k, self.vocab_size)
        return drafts, torch.stack(probs, dim=1)

    def propose_tensors(
        self,
        token_ids_list: Sequence[Sequence[int]],
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Like :meth:`propose` but drafts as a ``[B, k]`` long tensor, ready for the samplers."""
        drafts, probs = self.propose(token_ids_list, k)
        return pad_draft_token_ids(drafts, k), probs

    def release(self, keys: Sequence[Hashable]) -> None:
        """Drop the model's caches of requests that ended."""
        self.lm.release(keys)


def make_truncated_draft(model_dir: str | Path, num_layers: int, out_dir: str | Path) -> str:
    """Save the first ``num_layers`` decoder layers of ``model_dir`` as a draft checkpoint.

    The embeddings, final norm and LM head are kept, so the draft shares the tokenizer and
    vocabulary: an "early exit" of the target, a free draft model (LayerSkip-style). Written
    once; an existing complete ``out_dir`` is reused.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return str(out)
    config = AutoConfig.from_pretrained(str(model_dir))
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be in [1, {config.num_hidden_layers}], got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return str(out)
