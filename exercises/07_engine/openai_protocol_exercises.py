"""Exercises 07.S1a, 07.S1b of 07_engine: your versions of vllm_from_scratch/openai_protocol.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from vllm_from_scratch.openai_protocol import APIError, _SamplingFields
from vllm_from_scratch.sampling_params import SamplingParams


def check_supported_sampling(self) -> None:
    """Refuse what the engine cannot do, naming the field (400): a field no API defines, and
    a known one the engine does not implement set to anything but its neutral value (so
    ``n`` other than 1, penalties and ``logit_bias`` until ``SamplingParams`` has them).

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
    """The shared checks, which judge every field by this endpoint's table: ``logprobs``,
    ``echo``, ``best_of`` other than 1 and a ``suffix`` are refused there too.

    Becomes ``CompletionRequest.check_supported`` (a method: ``self`` is the CompletionRequest).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Run the shared checks first (_SamplingFields.check_supported(self)), then raise
    APIError(..., param=FIELD) for logprobs, echo, best_of other than 1, and a suffix.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.S1b
    """
    raise NotImplementedError(
        "Exercise 07.S1b: implement CompletionRequest.check_supported — see 07_engine/topics/serving.md#exercises"
    )
