"""Exercises 07.3, 07.3b of 07_engine: your versions of vllm_from_scratch/layers/linear.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_from_scratch.layers.linear import ColumnParallelLinear


def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None) -> None:
    """Load q, k and v checkpoint tensors into their slices of the fused QKV weight

    Becomes ``QKVParallelLinear.weight_loader`` (a method: ``self`` is the QKVParallelLinear).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: loaded_shard_id is 'q', 'k' or 'v': find that shard's offset and size in the fused
    output dimension (this rank's heads only), narrow the checkpoint tensor to this rank's
    slice, and copy it there.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.3
    """
    raise NotImplementedError(
        "Exercise 07.3: implement QKVParallelLinear.weight_loader — see 07_engine/README.md#exercises"
    )


def merged_weight_loader(
    self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
) -> None:
    # The shard id is optional only so that this still overrides ColumnParallelLinear's
    # two-argument loader; a fused weight cannot be loaded without naming its part.
    """Load gate and up checkpoint tensors into their halves of the fused gate_up weight

    Becomes ``MergedColumnParallelLinear.weight_loader`` (a method: ``self`` is the
    MergedColumnParallelLinear). Call parent methods as ``Parent.method(self, ...)``, not
    ``super()``.

    Hint: loaded_shard_id is the index of a part of self.output_sizes (None is a ValueError):
    the part starts at the sum of the sizes before it, divided by self.tp_size; narrow the
    checkpoint tensor to this rank's slice (self.tp_rank) of that part and copy it there.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.3b
    """
    raise NotImplementedError(
        "Exercise 07.3b: implement MergedColumnParallelLinear.weight_loader — see 07_engine/README.md#exercises"
    )
