"""Exercise 01.5 of 01_paged_kv: your versions of store_kvcache.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 01_paged_kv/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch

from store_kvcache import _check_args


def store_kvcache_torch(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into the slots ``slot_mapping``.

    ``k_cache``/``v_cache`` are one layer's ``[num_blocks, block_size, kv_heads, head_dim]``
    tensors, written in place. Slots equal to ``-1`` are skipped.

    Hint: View k_cache as [num_slots, kv_heads, head_dim] and index_copy_ the kept rows into it;
    validate the arguments first (_check_args).

    Checked by: pytest 01_paged_kv/ --impl=student --exercise 01.5
    """
    raise NotImplementedError("Exercise 01.5: implement store_kvcache_torch — see 01_paged_kv/README.md#exercises")
