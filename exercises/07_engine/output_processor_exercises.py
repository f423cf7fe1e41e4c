"""Exercise 07.5 of 07_engine: your versions of vllm_from_scratch/output_processor.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations


def update(self, all_token_ids: list[int]) -> None:
    """Streaming text that never splits a character

    Becomes ``IncrementalDetokenizer.update`` (a method: ``self`` is the
    IncrementalDetokenizer). Call parent methods as ``Parent.method(self, ...)``, not
    ``super()``.

    Hint: Decode the new tokens with a few tokens of left context, and only release text once it
    no longer ends in an incomplete UTF-8 character (the replacement character).

    Checked by: pytest 07_engine/ --impl=student --exercise 07.5
    """
    raise NotImplementedError(
        "Exercise 07.5: implement IncrementalDetokenizer.update — see 07_engine/README.md#exercises"
    )
