"""Exercise 01.4 of 01_paged_kv: your versions of kv_cache.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 01_paged_kv/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch


def build_slot_mapping(
    block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, seq_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Slots of token ``positions`` given each sequence's block table, without a Python loop.

    Args:
        block_tables: ``[batch, max_blocks]`` integer block tables (padding past a sequence's
            blocks may hold anything, it is never read for a valid position).
        positions: token positions. Either ``[batch]`` (one token per sequence: decode) or
            ``[num_tokens]`` together with ``seq_ids``.
        block_size: tokens per block.
        seq_ids: ``[num_tokens]`` row of ``block_tables`` each position belongs to; ``None``
            means row ``i`` for position ``i``. A negative position maps to slot ``-1``
            ("do not store", e.g. padding).

    Returns:
        ``[num_tokens]`` int64 slots ``block_tables[s, p // block_size] * block_size + p % block_size``.

    Hint: Gather block_tables[seq_ids, positions // block_size] with advanced indexing; negative
    positions (padding) become slot -1. ValueErrors: a position past its row's block table
    (naming the block table), a block_size that is not a positive int, seq_ids of another shape
    than positions, and without seq_ids, positions of another length than block_tables' rows
    (each naming its argument).

    Checked by: pytest 01_paged_kv/ --impl=student --exercise 01.4
    """
    raise NotImplementedError("Exercise 01.4: implement build_slot_mapping — see 01_paged_kv/README.md#exercises")
