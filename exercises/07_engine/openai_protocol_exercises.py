"""Exercises 07.S1a, 07.S1b of 07_engine: your versions of vllm_from_scratch/openai_protocol.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from vllm_from_scratch.openai_protocol import (
    IDENTIFYING_FIELDS,
    REFUSAL_REASONS,
    APIError,
    _is_neutral,
    _SamplingFields,
    engine_fields,
)


def check_supported_sampling(self) -> None:
    """Refuse what the engine cannot do, naming the field (400): a field no API defines, and
    a known one the engine does not implement set to anything but its neutral value (beam
    search, guided decoding, tools, ...), with its :data:`REFUSAL_REASONS` entry if it has one.

    Becomes ``_SamplingFields.check_supported`` (a method: ``self`` is the _SamplingFields).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: A field in self.model_extra that is not in self.KNOWN_FIELDS is unknown: raise
    APIError(message, param=name, code="unknown_field"). Then every field of self.given_fields()
    that the model does not declare, the engine does not take (engine_fields(self.KNOWN_FIELDS))
    and that does not identify the caller (IDENTIFYING_FIELDS) must hold its neutral value
    (_is_neutral(value, self.KNOWN_FIELDS[name])), else APIError(..., param=name), its message
    ending with REFUSAL_REASONS[name] where there is one. stream_options without stream is
    refused too.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.S1a
    """
    raise NotImplementedError(
        "Exercise 07.S1a: implement _SamplingFields.check_supported — see 07_engine/topics/serving.md#exercises"
    )


def check_supported_completion(self) -> None:
    """The shared checks, which judge every field by this endpoint's table: ``best_of``
    other than 1, a ``suffix`` and ``prompt_embeds`` are refused there too.

    Becomes ``CompletionRequest.check_supported`` (a method: ``self`` is the CompletionRequest).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Run the shared checks, _SamplingFields.check_supported(self): they judge every field
    by this endpoint's own table, CompletionRequest.KNOWN_FIELDS (its neutral values for
    best_of, suffix, ...), so a completion request refuses what the engine would silently
    ignore.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.S1b
    """
    raise NotImplementedError(
        "Exercise 07.S1b: implement CompletionRequest.check_supported — see 07_engine/topics/serving.md#exercises"
    )
