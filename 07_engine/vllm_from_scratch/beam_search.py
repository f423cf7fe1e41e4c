"""Beam search as vLLM runs it (``LLM.beam_search``): every step, each live beam is one request
of one token, and the search keeps the best continuations.

A step turns each beam (its prompt and the tokens chosen so far) into a request with
``max_tokens=1`` and ``logprobs=2 * beam_width``: the engine returns the beam's most likely next
tokens with their log-probabilities (and the token it drew, at ``temperature``). Each candidate
extends its beam's summed log-probability; a candidate that is EOS ends its sequence (it joins
the finished ones), the others compete, and the ``beam_width`` best by score live on. After
``max_tokens`` steps, or once no beam is left, the finished and live sequences are ranked by
score and the ``beam_width`` best are returned.

Forking costs no copy of K/V. Beams that share a prefix share its blocks: each step's requests
hit the full blocks that the previous step computed (chapter 03's prefix cache, reference
counted: ``beam_width`` requests hold one prompt block), and compute only their last partial
block and the new token, as the ``n`` completions of one request do (``parallel_sampling.py``).
When the search ends every request has ended and every block is free.

The score (vLLM's ``get_beam_search_score``): ``cum_logprob / len ** length_penalty``, where
``len`` counts the prompt's tokens and the generated ones, less a final EOS. Hugging Face's
``generate(num_beams=...)`` differs in three ways, so the two agree only where those do not
matter: (1) it divides by the *generated* length, EOS included; (2) it finishes a sequence on EOS
only when that candidate ranks among the ``num_beams`` best of all beams' candidates at its step
(vLLM takes every EOS among each beam's ``2 * beam_width`` candidates); (3) it stops once
``num_beams`` sequences have finished and none of the live ones can beat them (``early_stopping``),
where vLLM always runs ``max_tokens`` steps unless no beam is live. Without EOS (vLLM's
``ignore_eos``, transformers' ``eos_token_id=None``) every sequence has the same length, and the
two return the same sequences with the same summed log-probabilities
(``07_engine/tests/test_beam_search.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_from_scratch.outputs import Logprob
from vllm_from_scratch.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One sequence of a beam search (vLLM's fields).

    Args:
        tokens: the prompt's token ids followed by the generated ones.
        logprobs: per generated token, the candidates its step scored (``{token_id: Logprob}``).
        cum_logprob: the generated tokens' summed log-probability.
        text: ``tokens`` decoded, prompt included (as vLLM returns it); None without a tokenizer.
        finish_reason, stop_reason: None, as vLLM's offline search leaves them.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's score: ``cum_logprob / len ** length_penalty``, ``len`` the whole sequence's
    length (prompt included) less a final EOS, at least 1."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (max(length, 1) ** length_penalty)


# One engine step for a batch of beams: for each beam (its token ids), the candidates for its next
# token with their log-probabilities.
ExpandBeams = Callable[[list[list[int]]], list[dict[int, Logprob]]]


def beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_id: int | None,
    expand: ExpandBeams,
    on_step: Callable[[], None] | None = None,
) -> list[list[BeamSearchSequence]]:
    """Search every prompt at once (one ``expand`` call per step for all live beams); returns
    each prompt's ``beam_width`` best sequences, best first. ``on_step`` runs after each step."""

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)

    live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(p))] for p in prompts]
    finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [beam for group in live for beam in group]
        if not beams:
            break
        candidates = iter(expand([beam.tokens for beam in beams]))
        for i, group in enumerate(live):
            grown = []
            for beam in group:
                scored = next(candidates)
                for token, logprob in scored.items():
                    child = BeamSearchSequence(
                        beam.tokens + [token], beam.logprobs + [scored], beam.cum_logprob + logprob.logprob
                    )
                    if token == eos_token_id and not params.ignore_eos:
                        finished[i].append(child)
                    else:
                        grown.append(child)
            live[i] = sorted(grown, key=score, reverse=True)[: params.beam_width]
        if on_step is not None:
            on_step()
    return [sorted(done + rest, key=score, reverse=True)[: params.beam_width] for done, rest in zip(finished, live)]
