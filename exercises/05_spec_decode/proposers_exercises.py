"""Exercise 05.1 of 05_spec_decode: your versions of proposers.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 05_spec_decode/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from typing import Sequence


def propose_one(self, token_ids: Sequence[int], k: int) -> list[int]:
    """Drafts for one request: up to ``k`` tokens, [] when no suffix n-gram recurs.

    Becomes ``NgramProposer.propose_one`` (a method: ``self`` is the NgramProposer). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: For n from max_n down to min_n, look for the last n tokens earlier in the context; the
    longest n wins, and of its matches the most recent; propose up to k tokens that followed it.

    Checked by: pytest 05_spec_decode/ --impl=student --exercise 05.1
    """
    raise NotImplementedError("Exercise 05.1: implement NgramProposer.propose_one — see 05_spec_decode/README.md#exercises")
