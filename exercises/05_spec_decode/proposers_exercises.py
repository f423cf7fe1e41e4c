"""Exercises 05.4, 05.5 of 05_spec_decode: your versions of proposers.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 05_spec_decode/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from proposers import common_prefix_len


def propose_one(self, token_ids: Sequence[int], k: int) -> list[int]:
    """Drafts for one request: up to ``k`` tokens, [] when no suffix n-gram recurs.

    Becomes ``NgramProposer.propose_one`` (a method: ``self`` is the NgramProposer). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: For n from max_n down to min_n, look for the last n tokens earlier in the context; the
    longest n wins, and of its matches the most recent; propose up to k tokens that followed it.
    A negative k is a ValueError.

    Checked by: pytest 05_spec_decode/ --impl=student --exercise 05.4
    """
    raise NotImplementedError(
        "Exercise 05.4: implement NgramProposer.propose_one — see 05_spec_decode/README.md#exercises"
    )


def get_logits(self, token_ids: Sequence[int], num_logits: int = 1, slot: Hashable = 0) -> torch.Tensor:
    """``[num_logits, V]`` float32 logits predicting the token after each last position.

    Becomes ``HFCausalLM.get_logits`` (a method: ``self`` is the HFCausalLM). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Under torch.inference_mode(): find how much of the slot's cached ids is a prefix of
    token_ids (at most len - num_logits, so the wanted logits are computed), crop the cache to
    it, run the model on the rest with use_cache=True and logits_to_keep=num_logits, remember
    the new cache and ids, count the forward and the tokens computed. num_logits outside [1,
    len(token_ids)] is a ValueError.

    Checked by: pytest 05_spec_decode/ --impl=student --exercise 05.5
    """
    raise NotImplementedError("Exercise 05.5: implement HFCausalLM.get_logits — see 05_spec_decode/README.md#exercises")
