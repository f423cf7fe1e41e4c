"""Exercise 05.3 of 05_spec_decode: your versions of rejection_sampler_triton.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 05_spec_decode/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spec_decode import PLACEHOLDER_TOKEN_ID, RejectionNoise, sample_rejection_noise, validate_rejection_inputs


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    noise: RejectionNoise | None = None,
    block_v: int = 1024,
) -> torch.Tensor:
    """Triton twin of :func:`spec_decode.rejection_sample` (same arguments, same result).

    ``block_v`` is the vocabulary chunk a program streams at a time (a power of two).

    Hint: Write the kernel (_rejection_sample_kernel: one program per request, walk its drafts,
    accept or stop, then a chunked running argmax of weights / exponential noise over the
    vocabulary in blocks of block_v) and this launcher. Use the same RejectionNoise as
    rejection_sample, so both agree exactly. A block_v that is not a power of two is a
    ValueError.

    Checked by: pytest 05_spec_decode/ --impl=student --exercise 05.3
    """
    raise NotImplementedError(
        "Exercise 05.3: implement rejection_sample_triton — see 05_spec_decode/README.md#exercises"
    )
