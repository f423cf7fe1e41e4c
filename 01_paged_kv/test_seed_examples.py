"""The slot-mapping examples of nano-vllm's runtime flow (docs/sources.md, seed 004), recomputed.

Each example gives block tables and token positions; its slots follow from
``slot = block_table[pos // block_size] * block_size + pos % block_size``. The README's table of
these examples quotes what this file asserts.
"""

import pytest
import torch

from block_manager import BlockManager
from kv_cache import build_slot_mapping
from sequence import Sequence


def slots(block_tables: list[list[int]], positions: list[list[int]], block_size: int) -> list[int]:
    """Slots of ``positions[i]`` of sequence ``i``, batched and per sequence; both must agree."""
    width = max(len(t) for t in block_tables)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in block_tables])
    seq_ids = torch.tensor([i for i, pos in enumerate(positions) for _ in pos])
    flat = torch.tensor([p for pos in positions for p in pos])
    batched = build_slot_mapping(table, flat, block_size, seq_ids).tolist()

    bm = BlockManager(num_blocks=max(max(t) for t in block_tables) + 1, block_size=block_size)
    per_sequence = []
    for t, pos in zip(block_tables, positions):
        seq = Sequence(range(pos[-1] + 1), block_size)
        seq.block_table = list(t)
        per_sequence += [bm.slot_mapping(seq, p, p + 1)[0] for p in pos]
    assert batched == per_sequence
    return batched


def test_prefill_listing_is_right_as_printed():
    # Two sequences, 16-token blocks; seq 1 has 3 of its 5 tokens cached, seq 2 none of its 3.
    assert slots([[0, 1], [2]], [[3, 4], [0, 1, 2]], 16) == [3, 4, 32, 33, 34]


def test_decode_listing_writes_position_6_not_7():
    # Lengths 7, 3 and 5: the new tokens sit at positions 6, 2 and 4. The listing wrote 7 for
    # the first (the token's *value* in its example, [1..7]), so [7, 34, 52].
    assert slots([[0, 1], [2], [3, 4]], [[6], [2], [4]], 16) == [6, 34, 52]


PREFILL_CHART = ([[5, 12], [7, 8, 9]], [[0, 1, 2], [2, 3]])  # block tables, positions per sequence
PREFILL_CHART_PRINTED = [10, 11, 12, 15, 16]
DECODE_CHART = ([[0, 1, 2], [3, 4]], [[9], [4]])
DECODE_CHART_PRINTED = [160, 80]


def test_prefill_flow_chart_corrected():
    # Block size 2: the only one at which seq 1's 3 tokens need its 2 blocks and its first two
    # slots are the printed 10, 11. Position 2 is in block 12 (24), and seq 2's new positions
    # 2 and 3 are in block 8 (16, 17); the chart printed 12, 15, 16.
    assert slots(*PREFILL_CHART, 2) == [10, 11, 24, 16, 17]


def test_decode_flow_chart_corrected():
    # Block size 4: 10 and 5 tokens need exactly the 3 and 2 blocks listed. The chart printed
    # each sequence's length times 16, not a slot.
    assert slots(*DECODE_CHART, 4) == [9, 16]


@pytest.mark.parametrize(
    "chart, printed", [(PREFILL_CHART, PREFILL_CHART_PRINTED), (DECODE_CHART, DECODE_CHART_PRINTED)]
)
def test_no_block_size_gives_the_flow_charts_slots(chart, printed):
    for block_size in range(1, 65):
        try:
            computed = slots(*chart, block_size)
        except ValueError:  # the positions need more blocks than the table holds
            continue
        assert computed != printed, block_size
