"""Exercise 07.G1 of 07_engine: your versions of vllm_from_scratch/structured_output.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch

from vllm_from_scratch.structured_output import GrammarOutput, xgr


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar_output: GrammarOutput, request_ids: list[str], num_rows: list[int]
) -> None:
    """Set to -inf, in place, every logit a constrained row's mask forbids; one kernel call.

    ``logits [B, V]`` holds ``num_rows[i]`` consecutive rows for sampling request
    ``request_ids[i]`` (the runner's batch order); ``grammar_output``'s masks go to the rows of
    the requests it names, and the other rows are not read. The library's kernel (C++ on a CPU,
    Triton or CUDA on a GPU) indexes the mask and the logits by the same row, so the masks are
    first scattered into a ``[B, V / 32]`` all-allowed mask. A vocabulary narrower than
    :data:`KERNEL_MIN_VOCAB` is masked by unpacking the bits with torch instead.

    Hint: Find each sampling request's first logits row (num_rows[i] consecutive rows per
    request, in request_ids order); walk grammar_output's requests and their rows in order,
    pairing each logits row with its mask row; token t of a mask row is allowed when bit t % 32
    of word t // 32 is 1. Refused logits become -inf; rows of requests without a mask stay as
    they are.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.G1
    """
    raise NotImplementedError(
        "Exercise 07.G1: implement apply_grammar_bitmask — see 07_engine/topics/structured_outputs.md#exercises"
    )
