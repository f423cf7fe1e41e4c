"""What the engine returns: vLLM's ``RequestOutput`` and ``CompletionOutput``, one record for every
caller.

Named and shaped as in ``vllm/outputs.py``, so that code written for vLLM reads them unchanged
(``out.outputs[0].text``). ``LLMEngine.step`` returns them as requests advance and ``LLM.generate``
returns the finished ones; what each carries follows the request's
``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``): everything so far (``CUMULATIVE``,
the default), only this step's part (``DELTA``, what the server streams), or one record at the
end (``FINAL_ONLY``, what ``LLM.generate`` asks for). The output processor
(``output_processor.py``) makes them.

The book's chapters and the source documents read results as dicts (``out["text"]``);
``RequestOutput.__getitem__`` keeps that shorthand working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The seeds' dict keys, and where each lives on vLLM's objects: the first completion's text and
# token ids, and the request's prefix-cache hits.
_SHORTHAND = {"text": "completion", "token_ids": "completion", "num_cached_tokens": "request"}


@dataclass
class Logprob:
    """One token's log-probability (vLLM's ``vllm.logprobs.Logprob``).

    Args:
        logprob: the natural-log probability under the model's raw distribution (vLLM V1's
            default ``logprobs_mode``: before penalties, temperature, top-k and top-p).
        rank: 1-based rank in that distribution: how many tokens are at least as likely.
        decoded_token: the token decoded alone (``tokenizer.decode([id])``, as vLLM does);
            None without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's fields; ``SamplingParams.n`` gives ``n`` of them).

    Args:
        index: which of the request's ``n`` completions this is, from 0.
        text: the generated text, cut before a stop string that ended it.
        token_ids: the generated token ids (a stop token that ended it included, as in vLLM).
        cumulative_logprob: the sum of the sampled tokens' log-probabilities; None unless
            ``SamplingParams.logprobs`` was set (as in vLLM).
        logprobs: one dict per generated token, ``{token_id: Logprob}``: the sampled token and
            the ``SamplingParams.logprobs`` most likely ones (``logprobs`` or ``logprobs + 1``
            entries, as the sampled token is among them or not); None unless requested.
        finish_reason: "stop" (EOS, a stop token or a stop string), "length" (``max_tokens`` or
            ``max_model_len``), "abort", or "error" (the engine could not go on with it: its
            distribution had no token to draw, or its step failed; the server's 500).
        stop_reason: the stop string or ``stop_token_ids`` entry that ended it; None for EOS,
            a length stop or an abort.
        error: why the engine ended it with finish reason "error" (the book's addition: the
            server's 500 says it); None otherwise.

    With ``RequestOutputKind.DELTA``, ``text``, ``token_ids`` and ``logprobs`` hold only what this
    record adds to the completion (``cumulative_logprob`` is the running sum either way).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def finished(self) -> bool:
        """Whether this completion has ended (vLLM's method)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt (vLLM's fields).

    Args:
        request_id: the engine's id for the request.
        prompt: the prompt's text; None when it was given as token ids (as in vLLM).
        prompt_token_ids: the prompt's token ids, as the model saw them.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt token:
            None for the first (nothing predicts it), then ``{token_id: Logprob}`` of that token
            and the most likely ones at its position; None unless requested.
        outputs: the completions this record is about: all ``n``, in index order, at the end of
            a ``FINAL_ONLY`` request (``LLM.generate``); otherwise the one that advanced (its
            ``index`` says which), as vLLM streams a request with ``n`` > 1.
        finished: whether the request has ended: every one of its completions.
        num_cached_tokens: prompt tokens that were not computed (prefix-cache hits); with
            ``n`` > 1, completion 0's, the one that computed the prompt for the others.

    ``prompt_logprobs`` come with completion 0, once with ``DELTA`` (in its first record).

    ``out["text"]``, ``out["token_ids"]`` and ``out["num_cached_tokens"]`` are the book's
    shorthand, from the source documents' dict results: the first completion's text and token
    ids, and the request's ``num_cached_tokens``. vLLM's objects have no such keys.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = None

    def __getitem__(self, key: str) -> Any:
        where = _SHORTHAND.get(key)
        if where is None:
            raise KeyError(f"{key!r}: a RequestOutput's shorthand keys are {list(_SHORTHAND)}")
        return getattr(self if where == "request" else self.outputs[0], key)

    def keys(self) -> list[str]:
        """The shorthand's keys, so ``dict(out)`` gives the book's old dict result."""
        return list(_SHORTHAND)
