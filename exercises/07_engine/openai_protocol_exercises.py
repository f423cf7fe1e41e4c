"""Exercises 07.S1a, 07.S1b of 07_engine: your versions of vllm_from_scratch/openai_protocol.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from vllm_from_scratch.openai_protocol import APIError, _SamplingFields


def check_supported_sampling(self) -> None:
    """Refuse what the engine cannot do, naming the field (400).

    Becomes ``_SamplingFields.check_supported`` (a method: ``self`` is the _SamplingFields).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Raise APIError(message, param=FIELD) for n != 1, a presence or frequency penalty,
    logit_bias, and stream_options without stream.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.S1a
    """
    raise NotImplementedError(
        "Exercise 07.S1a: implement _SamplingFields.check_supported — see 07_engine/topics/serving.md#exercises"
    )


def check_supported_completion(self) -> None:
    """Refuse completion fields the engine cannot honour (logprobs, echo, best_of, suffix)

    Becomes ``CompletionRequest.check_supported`` (a method: ``self`` is the CompletionRequest).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Run the shared checks first (_SamplingFields.check_supported(self)), then raise
    APIError(..., param=FIELD) for logprobs, echo, best_of other than 1, and a suffix.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.S1b
    """
    raise NotImplementedError(
        "Exercise 07.S1b: implement CompletionRequest.check_supported — see 07_engine/topics/serving.md#exercises"
    )
