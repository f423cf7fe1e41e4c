"""Turn the last-token logits of a batch into next tokens, one vectorized pass for all rows.

Each row has its own temperature (0: greedy), top-k, top-p and optional seed. A row samples by
inverse transform: the first token whose cumulative probability reaches ``u`` times the row's
total, with one uniform ``u`` per row, is an exact draw from the row's distribution. A seeded
request draws its ``u`` from its own generator, so its tokens do not depend on what else is in
the batch (:func:`uniform_noise`). Chapter 05's rejection sampler draws its recovered tokens by
the exponential race instead, whose ``[rows, vocab]`` noise its kernels take as an input
(:func:`exponential_noise`).

Every row gets a token id inside the vocabulary or :data:`NO_TOKEN`, whatever its logits hold
(:func:`resolve_infinite_logits`): a row whose largest logit is ``+inf`` draws uniformly among its
``+inf`` tokens, and a row with no token left (every logit ``-inf``) or a NaN has none.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# What a row with nothing to draw gets instead of a token id (chapter 05's placeholder value):
# the engine ends its request with finish reason "error" rather than feed the id to the model.
NO_TOKEN = -1


def resolve_infinite_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, has_token)``: ``logits [B, V]`` with every row that holds ``+inf`` replaced by
    0 on its ``+inf`` entries and ``-inf`` elsewhere, and whether each row has a token to draw.

    A repetition penalty of 1e-300 is 0 in float32, and a positive logit divided by it is
    ``+inf``; softmax then gives NaN (``inf - inf``) and inverse transform an id past the
    vocabulary. The limit of a row whose largest logits grow without bound is the uniform
    distribution over them, which is what the rewritten row samples, greedy rows included (the
    first of them). A row whose largest logit is ``-inf`` (every token banned) or NaN (broken
    model output) has no token: ``has_token`` is False there, and the sampler returns
    :data:`NO_TOKEN` for it. One ``amax`` over the batch decides; rows without ``+inf`` are
    returned as they are, and the tensor itself when no row has one.
    """
    row_max = logits.amax(dim=-1)
    has_token = row_max > float("-inf")  # False for NaN too
    infinite_rows = row_max == float("inf")
    if bool(infinite_rows.any()):
        limit = torch.full_like(logits, float("-inf")).masked_fill_(logits == float("inf"), 0.0)
        logits = torch.where(infinite_rows.unsqueeze(1), limit, logits)
    return logits, has_token


ARGMAX_CHUNK = 256  # entries per chunk of argmax_by_chunks


def argmax_by_chunks(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``logits [B, V]``, the first of tied maxima as there, in
    about a tenth of its time on a CPU (32 rows of 49,152 float32: 1.33 -> 0.12 ms).

    torch's CPU argmax carries an index through a scalar loop, while ``amax`` is vectorized. So
    ``amax`` finds each chunk's largest value, a small argmax the first chunk holding the row's
    largest, and an argmax inside that chunk its first position; entries past the last whole
    chunk are compared on their own, and win only when strictly larger. A row holding a NaN gets
    some index in ``[0, V)`` (the sampler gives such a row no token anyway).
    """
    rows, vocab = logits.shape
    whole = vocab // ARGMAX_CHUNK * ARGMAX_CHUNK
    if whole == 0 or logits.device.type != "cpu":  # a GPU's argmax is a parallel reduction already
        return logits.argmax(dim=-1)
    chunks = logits[:, :whole].reshape(rows, whole // ARGMAX_CHUNK, ARGMAX_CHUNK)
    chunk_max = chunks.amax(dim=-1)
    best_chunk = chunk_max.argmax(dim=-1)
    picked = chunks[torch.arange(rows, device=logits.device), best_chunk]
    best = best_chunk * ARGMAX_CHUNK + picked.argmax(dim=-1)
    if whole == vocab:
        return best
    tail = logits[:, whole:]
    best_max = chunk_max.gather(1, best_chunk.unsqueeze(1)).squeeze(1)
    return torch.where(tail.amax(dim=-1) > best_max, whole + tail.argmax(dim=-1), best)


def keep_in_vocabulary(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``token_ids`` with every id outside ``[0, vocab_size)`` replaced by :data:`NO_TOKEN`.

    An id past the vocabulary would reach the embedding lookup of the next forward and abort
    the process in C++ with every client's request; checked here (two comparisons on a ``[B]``
    tensor), a sampler bug costs one request, which the engine ends with an error.
    """
    return token_ids.masked_fill((token_ids < 0) | (token_ids >= vocab_size), NO_TOKEN)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k and top-p set.

    ``top_ks`` holds ``vocab_size`` for "off"; ``top_ps`` holds 1.0 for "off". The most likely
    token always survives, so no row is left empty.
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_ks is not None:
        mask |= torch.arange(vocab, device=logits.device).unsqueeze(0) >= top_ks.unsqueeze(1)
    if top_ps is not None:
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        # Drop a token when the tokens *before* it already reach top_p.
        mask |= (probs.cumsum(dim=-1) - probs) >= top_ps.unsqueeze(1)
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def check_generators(generators: Sequence[torch.Generator | None], device: torch.device) -> None:
    """``ValueError`` naming ``generators`` unless each one is on ``device``'s type: ATen refuses
    a CPU generator for a CUDA tensor, and says so only once a seeded request reaches a GPU."""
    for gen in generators:
        if gen is not None and gen.device.type != device.type:
            raise ValueError(f"generators must be on the tensors' device ({device.type}), got one on {gen.device}")


def uniform_noise(
    num_rows: int, width: int, device: torch.device, generators: Sequence[torch.Generator | None] | None = None
) -> torch.Tensor:
    """``[num_rows, width]`` uniforms in ``[0, 1)``: one draw for the whole batch from the device's
    default generator, then one draw per *seeded* row from that row's generator.

    A seeded row consumes ``width`` numbers of its own generator per call whatever the batch, so
    its tokens do not depend on what else runs. Torch generators have no batched draw, so each
    seeded row costs one launch (as in vLLM V1); unseeded rows never do.
    """
    generators = generators or ()
    check_generators(generators, device)
    uniform = torch.empty(num_rows, width, device=device)
    if sum(g is not None for g in generators) < num_rows:
        uniform.uniform_()
    for row, gen in enumerate(generators):
        if gen is not None:
            uniform[row].uniform_(generator=gen)
    return uniform


class EngineRandomStream:
    """The engine's global seed (``EngineConfig.seed``, vLLM's ``--seed``) at work: the random
    stream every row without a generator of its own draws from.

    Those rows draw their noise from the device's default generator, all in one launch
    (:func:`uniform_noise`). :meth:`active` swaps that generator's state for the engine's around
    a step's sampling and back after: the stream starts at ``seed`` and only sampling advances
    it, so the same requests in the same order give the same tokens on every run, and the
    caller's own random state is neither read nor changed (vLLM reseeds its engine process,
    which is not the caller's). ``seed`` None: the default generator as it stands.
    """

    def __init__(self, seed: int | None, device: torch.device):
        self.seed = seed
        self._default: torch.Generator | None = None
        if seed is not None:
            if device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                self._default = torch.cuda.default_generators[index]
            else:
                self._default = torch.default_generator
            # The stream's start: the state a generator seeded with ``seed`` has.
            self._state = torch.Generator(device).manual_seed(seed).get_state()

    @contextmanager
    def active(self) -> Iterator[None]:
        default = self._default
        if default is None:
            yield
            return
        caller_state = default.get_state()
        default.set_state(self._state)
        try:
            yield
        finally:
            self._state = default.get_state()
            default.set_state(caller_state)


def exponential_noise(
    num_rows: int, vocab_size: int, device: torch.device, generators: Sequence[torch.Generator | None] | None = None
) -> torch.Tensor:
    """``[num_rows, vocab_size]`` Exp(1) noise drawn as :func:`uniform_noise` draws, for chapter
    05's exponential race ``argmax(p / E)``."""
    # E = -log(U), U ~ Uniform[0, 1): a CPU draws uniforms ~6x faster than exponential_()
    # (5 against 30 ms for 32 x 49k). U = 0 gives E = inf (weight 0: fine); a U rounded to 1
    # would give E = 0 and 0 / 0 = NaN, which argmax would pick, hence the floor.
    uniform = uniform_noise(num_rows, vocab_size, device, generators)
    return uniform.log_().neg_().clamp_(min=torch.finfo(torch.float32).tiny)


def _long_tensor(ids: Sequence[int]) -> torch.Tensor:
    """A CPU int64 tensor of ``ids`` through an ``array`` buffer: ~10x faster than
    ``torch.tensor(list)`` for the thousands of ids a prompt has."""
    if not ids:
        return torch.empty(0, dtype=torch.long, device="cpu")  # frombuffer refuses an empty buffer
    return torch.frombuffer(array("q", ids), dtype=torch.long)


@dataclass
class Penalties:
    """vLLM's three penalties, as sparse ``(batch row, token id)`` entries of the penalized rows.

    ``seen_*`` lists each distinct token of a row's prompt or output once (the repetition
    penalty's set); ``out_*`` each distinct output token with its count (frequency and
    presence). A step touches only these entries, O(tokens) rather than O(rows x vocabulary),
    and rows without penalties cost nothing. ``repetition``, ``frequency`` and ``presence``
    are each entry's row's setting.
    """

    seen_rows: torch.Tensor
    seen_ids: torch.Tensor
    repetition: torch.Tensor
    out_rows: torch.Tensor
    out_ids: torch.Tensor
    out_counts: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor

    @classmethod
    def from_rows(cls, rows: list[int], requests: Sequence, vocab_size: int, device: torch.device | str) -> Penalties:
        """``requests[i]`` (prompt and completion token ids, ``sampling_params``) owns batch row ``rows[i]``."""

        def keys(lists: list[Sequence[int]]) -> torch.Tensor:
            # One int64 key per (row, token): row * vocab + token, so torch.unique dedups pairs.
            parts = [_long_tensor(ids) + r * vocab_size for r, ids in zip(rows, lists)]
            return torch.cat(parts).to(device)

        out_keys, out_counts = torch.unique(keys([r.completion_token_ids for r in requests]), return_counts=True)
        seen_keys = torch.unique(torch.cat([out_keys, keys([r.prompt_token_ids for r in requests])]))

        def setting(name: str, entry_rows: torch.Tensor) -> torch.Tensor:
            per_row = torch.ones(max(rows) + 1, dtype=torch.float32, device=device)
            per_row[rows] = torch.tensor(
                [float(getattr(r.sampling_params, name)) for r in requests], dtype=torch.float32, device=device
            )
            return per_row[entry_rows]

        seen_rows, out_rows = seen_keys // vocab_size, out_keys // vocab_size
        return cls(
            seen_rows,
            seen_keys % vocab_size,
            setting("repetition_penalty", seen_rows),
            out_rows,
            out_keys % vocab_size,
            out_counts.float(),
            setting("frequency_penalty", out_rows),
            setting("presence_penalty", out_rows),
        )

    def apply(self, logits: torch.Tensor) -> None:
        """vLLM's ``apply_penalties``, in place on ``logits [B, V]``: repetition over the seen
        tokens (divide a positive logit, multiply a negative one), then frequency and presence
        over the output tokens."""
        seen = (self.seen_rows, self.seen_ids)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / self.repetition, values * self.repetition)
        out = (self.out_rows, self.out_ids)
        logits[out] -= self.frequency * self.out_counts + self.presence


@dataclass(frozen=True)
class ProcessorEntries:
    """One request's fixed logits-processor entries as dense vocabulary rows, built once: its
    ``logit_bias`` (0 elsewhere), the ids ``min_tokens`` bans (its stop ids, EOS included) and
    the ids ``allowed_token_ids`` leaves out.

    A step applies one such row to each of the request's batch rows, and the ``n`` completions
    of a request share theirs. Walking a client's dict in Python per row and per step cost 5.7 s
    a step for a 49k-entry ``logit_bias`` on 64 completions; sparse entries per row (10 M of
    them for 256 completions of a 40k-entry bias) cost 50 ms more in indexing than a dense row.
    """

    bias: torch.Tensor | None  # [V] float32
    banned: torch.Tensor | None  # [V] bool
    disallowed: torch.Tensor | None = None  # [V] bool: True outside allowed_token_ids

    @classmethod
    def of(cls, request: Any, vocab_size: int, device: torch.device | str) -> ProcessorEntries:
        params = request.sampling_params
        bias = banned = disallowed = None
        if params.logit_bias:
            bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            bias[ids] = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        # A stop id past the vocabulary can never be sampled anyway.
        stop_ids = [t for t in request.stop_token_ids if t < vocab_size] if params.min_tokens else []
        if stop_ids:
            banned = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            banned[torch.tensor(stop_ids, dtype=torch.long, device=device)] = True
        if params.allowed_token_ids:
            disallowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
            disallowed[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)] = False
        return cls(bias, banned, disallowed)


def banned_bad_words(bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The ids ``bad_words`` bans at the next position (vLLM's rule): the last token of each
    bad sequence whose other tokens are the last ones generated (a one-token word always)."""
    banned = []
    for sequence in bad_words_token_ids:
        prefix = len(sequence) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or list(output_token_ids[-prefix:]) == list(sequence[:prefix]):
            banned.append(sequence[-1])
    return banned


def _group_rows(
    rows: list[tuple[int, torch.Tensor]], device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(batch rows, entry)`` for each distinct entry among ``rows``' ``(row, entry)`` pairs."""
    groups: dict[int, tuple[list[int], torch.Tensor]] = {}
    for row, entry in rows:
        groups.setdefault(id(entry), ([], entry))[0].append(row)
    return [(torch.tensor(members, dtype=torch.long, device=device), entry) for members, entry in groups.values()]


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one batch's logits (a request repeats over its rows), vLLM
    V1's ``SamplingMetadata``.

    ``top_ks`` / ``top_ps`` are None when no row uses them; ``generators`` is None when no
    request is seeded. ``request_ids``, ``request_generators`` and ``num_logprobs`` (the
    ``SamplingParams.logprobs`` each asked for, None: none) have one entry per sampling request,
    in row order.

    The logits processors (:func:`apply_logits_processors`) are None when no row uses them:
    ``min_ps [B]``; ``allowed_mask``, ``logit_bias`` and ``min_tokens_mask`` as ``(batch rows,
    [V] row)`` groups, the rows that share one request's :class:`ProcessorEntries`;
    ``bad_words`` as the ``(rows, token ids)`` this step bans; ``penalties`` for the penalized
    rows.
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor | None
    top_ps: torch.Tensor | None
    generators: list[torch.Generator | None] | None
    request_ids: list[str]
    request_generators: list[torch.Generator | None]
    num_logprobs: list[int | None] = field(default_factory=list)
    min_ps: torch.Tensor | None = None
    allowed_mask: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    bad_words: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    min_tokens_mask: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    penalties: Penalties | None = None

    @classmethod
    def from_requests(
        cls,
        requests: Sequence,
        num_rows: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        entries_cache: dict[str, ProcessorEntries] | None = None,
    ) -> SamplingMetadata:
        """``requests[i]`` (with ``sampling_params`` and ``generator``) owns ``num_rows[i]`` rows.

        The logits processors also read a request's ``prompt_token_ids``,
        ``completion_token_ids`` and ``stop_token_ids`` (EOS included unless ``ignore_eos``),
        only when its parameters use them. A request with several rows (drafts) gets the same
        settings on each; the engine refuses the position-dependent ones (penalties,
        ``min_tokens``) with drafts. ``entries_cache`` keeps each request's
        :class:`ProcessorEntries` by request id from one step to the next (the model runner's;
        None: built for this call only).
        """
        sampling = [(r, n) for r, n in zip(requests, num_rows) if n]
        params = [r.sampling_params for r, n in sampling for _ in range(n)]
        request_generators = [r.generator for r, _ in sampling]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_ks = top_ps = None
        if any(p.top_k > 0 for p in params):
            top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        generators = [g for (r, n) in sampling for g in [r.generator] * n] if any(request_generators) else None
        metadata = cls(
            temps,
            top_ks,
            top_ps,
            generators,
            [r.request_id for r, _ in sampling],
            request_generators,
            [r.sampling_params.logprobs for r, _ in sampling],
        )
        if any(
            p.min_p > 0.0 or p.logit_bias or p.min_tokens or p.uses_penalties or p.allowed_token_ids or p.bad_words
            for p in params
        ):
            row_requests = [r for r, n in sampling for _ in range(n)]
            metadata._add_processors(row_requests, vocab_size, device, {} if entries_cache is None else entries_cache)
        return metadata

    def _add_processors(
        self, row_requests: list, vocab_size: int, device: torch.device | str, cache: dict[str, ProcessorEntries]
    ) -> None:
        params = [r.sampling_params for r in row_requests]
        if any(p.min_p > 0.0 for p in params):
            self.min_ps = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)

        # The n completions of one request share its logit_bias dict, stop set and allowed ids: built once.
        shared: dict[tuple[int, int, int], ProcessorEntries] = {}

        def entries(r: Any) -> ProcessorEntries:
            if r.request_id not in cache:
                key = (id(r.sampling_params.logit_bias), id(r.stop_token_ids), id(r.sampling_params.allowed_token_ids))
                if key not in shared:
                    shared[key] = ProcessorEntries.of(r, vocab_size, device)
                cache[r.request_id] = shared[key]
            return cache[r.request_id]

        def grouped(uses: Callable[[Any], Any], entry: str) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
            """The ``(rows, [V] row)`` groups of the rows that ``uses`` an entry and have one."""
            rows = [
                (i, row)
                for i, r in enumerate(row_requests)
                if uses(r) and (row := getattr(entries(r), entry)) is not None
            ]
            return _group_rows(rows, device) if rows else None

        self.logit_bias = grouped(lambda r: r.sampling_params.logit_bias, "bias")
        self.min_tokens_mask = grouped(lambda r: r.num_completion_tokens < r.sampling_params.min_tokens, "banned")
        self.allowed_mask = grouped(lambda r: r.sampling_params.allowed_token_ids, "disallowed")
        bad_rows: list[int] = []
        bad_ids: list[int] = []
        for i, r in enumerate(row_requests):
            if r.sampling_params.bad_words_token_ids:
                ids = banned_bad_words(r.sampling_params.bad_words_token_ids, r.completion_token_ids)
                bad_rows += [i] * len(ids)
                bad_ids += ids
        if bad_ids:
            self.bad_words = (_long_tensor(bad_rows).to(device), _long_tensor(bad_ids).to(device))
        penalized = [i for i, p in enumerate(params) if p.uses_penalties]
        if penalized:
            self.penalties = Penalties.from_rows(penalized, [row_requests[i] for i in penalized], vocab_size, device)

    @property
    def has_processors(self) -> bool:
        processors = (
            self.min_ps,
            self.allowed_mask,
            self.bad_words,
            self.logit_bias,
            self.min_tokens_mask,
            self.penalties,
        )
        return any(x is not None for x in processors)


def apply_logits_processors(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM V1's steps before temperature, top-k and top-p, on a copy of ``logits [B, V]``.

    In vLLM V1's order: ``allowed_token_ids`` (every other id to -inf), ``bad_words`` (the ids
    they ban at this position to -inf), ``min_tokens`` (EOS and stop tokens to -inf),
    ``logit_bias`` (added), then the penalties (repetition over prompt and output, then frequency and presence over the
    output), and ``min_p``. Greedy rows see all but ``min_p``, which never drops the argmax.
    ``logits`` itself is returned, untouched and uncopied, when no row uses any of them.

    ``min_p`` acts on probabilities after temperature ``T``: ``p_i < min_p * p_max`` is
    ``(l_i - l_max) / T < log(min_p)``, i.e. ``l_i < l_max + T * log(min_p)`` on the logits
    before temperature, so it is applied here and the sampler that follows is unchanged.
    """
    sampling = sampling_metadata
    if not sampling.has_processors:
        return logits
    logits = logits.float().clone()
    for rows, disallowed in sampling.allowed_mask or ():
        logits[rows] = logits[rows].masked_fill(disallowed, float("-inf"))
    if sampling.bad_words is not None:
        logits[sampling.bad_words] = float("-inf")
    for rows, banned in sampling.min_tokens_mask or ():
        logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
    for rows, bias in sampling.logit_bias or ():
        logits[rows] += bias
    if sampling.penalties is not None:
        sampling.penalties.apply(logits)
    if sampling.min_ps is not None:
        temps = sampling.temperatures.clamp(min=1e-5)
        threshold = logits.max(dim=-1).values + temps * torch.log(sampling.min_ps)  # log(0) = -inf: off
        logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))
    return logits


@dataclass
class LogprobsLists:
    """Scored positions as Python lists: per position, the scored token first (the sampled one,
    or the prompt's next token), then the most likely tokens, with their ids, log-probabilities
    and 1-based ranks. Rows may hold fewer top tokens than others (each request its own k)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[list[int]]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int]) -> LogprobsLists:
    """vLLM V1's ``gather_logprobs`` for ``logprobs [N, V]`` (log-softmaxed) and ``token_ids [N]``.

    Row ``i`` keeps its scored token then its ``num_logprobs[i]`` most likely tokens (one
    ``topk`` for the batch, at the largest k). A token's rank counts the tokens at least as
    likely as it (vLLM's ``batched_count_greater_than``: ``>=``), so the argmax has rank 1.
    """
    k = max(num_logprobs, default=0)
    scored = logprobs.gather(-1, token_ids.unsqueeze(1))
    ranks = (logprobs >= scored).sum(-1, keepdim=True)
    top = logprobs.topk(k, dim=-1)
    top_ranks = torch.arange(1, k + 1, device=logprobs.device).expand(len(token_ids), k)
    ids = torch.cat([token_ids.unsqueeze(1), top.indices], dim=1).tolist()
    values = torch.cat([scored, top.values], dim=1).tolist()
    all_ranks = torch.cat([ranks, top_ranks], dim=1).tolist()
    return LogprobsLists(
        [row[: n + 1] for row, n in zip(ids, num_logprobs)],
        [row[: n + 1] for row, n in zip(values, num_logprobs)],
        [row[: n + 1] for row, n in zip(all_ranks, num_logprobs)],
    )


@dataclass
class SamplerOutput:
    """One step's draw (vLLM V1's ``SamplerOutput``), by request id: the tokens each sampling
    request gained (one, or accepted drafts and one more; ``[NO_TOKEN]`` when it had nothing to
    draw) and, for those that asked, the logprobs of each of them (:class:`LogprobsLists`, one
    position per token)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)


class Sampler:
    """Greedy, temperature, top-k and top-p sampling with optional per-row generators, after vLLM
    V1's logits processors; :meth:`sample` is the whole sequence, :meth:`draw` the draw itself.

    ``vocab_size`` is the model's: an id outside it (a sampler bug) becomes :data:`NO_TOKEN`.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """One token per row of ``logits [B, V]`` (float32, one row per sampling request).

        vLLM V1's order: the logprobs of the raw distribution (its default ``logprobs_mode``,
        before every processor), then the logits processors, then the draw; each id is checked
        against the vocabulary (:func:`keep_in_vocabulary`).
        """
        metadata = sampling_metadata
        want = [i for i, k in enumerate(metadata.num_logprobs) if k is not None]
        raw_logprobs = logits[want].log_softmax(dim=-1) if want else None
        logits = apply_logits_processors(logits, metadata)
        sampled = self.draw(logits, metadata.temperatures, metadata.top_ks, metadata.top_ps, metadata.generators)
        sampled = keep_in_vocabulary(sampled, self.vocab_size)
        output = SamplerOutput({rid: [t] for rid, t in zip(metadata.request_ids, sampled.tolist())})
        if raw_logprobs is not None:
            # A NO_TOKEN row's request ends in error: its logprobs are scored at id 0 and dropped.
            scored = sampled[want].clamp(min=0)
            lists = gather_logprobs(raw_logprobs, scored, [metadata.num_logprobs[i] or 0 for i in want])
            for j, i in enumerate(want):
                output.logprobs[metadata.request_ids[i]] = LogprobsLists(
                    lists.token_ids[j : j + 1], lists.logprobs[j : j + 1], lists.ranks[j : j + 1]
                )
        return output

    @staticmethod
    def compute_probs(
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_ks: torch.Tensor | None = None,
        top_ps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The distribution each row samples from (one-hot on the argmax for greedy rows).

        Speculative decoding's rejection sampler needs these probabilities, not just a sample.
        """
        greedy = temperatures < 1e-5
        # Float32 temperatures promote 16-bit logits in the division itself (the runner passes float32).
        scaled = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures).unsqueeze(1).float()
        if top_ks is not None or top_ps is not None:
            scaled = apply_top_k_top_p(scaled, top_ks, top_ps)
        probs = scaled.softmax(dim=-1)
        if bool(greedy.any()):
            one_hot = torch.zeros_like(probs).scatter_(-1, argmax_by_chunks(logits).unsqueeze(1), 1.0)
            probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
        return probs

    @staticmethod
    def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
        """One exact draw per row by inverse transform: the first token whose cumulative
        probability reaches ``u`` times the row's total, ``u`` uniform in ``(0, 1]``.

        The point ``u * total`` is above 0 and at most the total, so the token found adds
        probability of its own: a zero-probability token (masked by top-k or top-p) never is.
        """
        cdf = probs.cumsum(dim=-1)
        u = 1.0 - uniform_noise(probs.shape[0], 1, probs.device, generators)
        return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)

    @staticmethod
    def draw(
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_ks: torch.Tensor | None = None,
        top_ps: torch.Tensor | None = None,
        generators: list[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """Next token per row of ``logits [B, V]``; ``temperatures [B]`` (< 1e-5: greedy).

        Always an id in ``[0, V)``, or :data:`NO_TOKEN` for a row with nothing to draw
        (:func:`resolve_infinite_logits` says which rows, and what ``+inf`` logits mean).
        """
        logits, has_token = resolve_infinite_logits(logits)
        greedy = temperatures < 1e-5
        if bool(greedy.all()):
            sampled = argmax_by_chunks(logits)
        else:
            probs = Sampler.compute_probs(logits, temperatures, top_ks, top_ps)
            sampled = Sampler.sample_from_probs(probs, generators)
            if bool(greedy.any()):
                sampled = torch.where(greedy, argmax_by_chunks(logits), sampled)
        return sampled.masked_fill_(~has_token, NO_TOKEN)
