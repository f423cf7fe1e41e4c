"""Linear layers split across tensor-parallel ranks, Megatron-style.

A column-parallel layer (output features split, no communication) followed by a row-parallel one
(input features split, one all-reduce) — q/k/v then o, gate/up then down — costs one all-reduce.
Each parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that copies *this
rank's* slice of a full checkpoint tensor; ``loader.py`` calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from vllm_from_scratch.layers.prepacked import PrepackableWeight

if TYPE_CHECKING:
    from typing_extensions import Unpack


class TPArgs(TypedDict, total=False):
    """The tensor-parallel keywords every layer takes (and a model passes down as ``**tp``)."""

    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup | None


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tp_size ({denominator})")
    return numerator // denominator


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    """Attach ``attrs`` to ``param`` as attributes, as vLLM's ``set_weight_attrs`` does: a
    ``Parameter`` has no ``weight_loader`` field, yet ``loader.py`` finds one there by ``getattr``."""
    for name, value in attrs.items():
        setattr(param, name, value)


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")


class LinearBase(PrepackableWeight, nn.Module):
    """``y = x W^T + b`` with W split along ``tp_dim`` (0: output rows, 1: input columns, None: not split)."""

    bias: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_dim: int | None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        _check_tp(tp_rank, tp_size)
        self.input_size, self.output_size = input_size, output_size
        self.tp_dim, self.tp_rank, self.tp_size, self.tp_group = tp_dim, tp_rank, tp_size, tp_group

    def _make_params(self, out_features: int, in_features: int, bias: bool) -> None:
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (small projections that are not worth splitting)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **tp: Unpack[TPArgs]):
        super().__init__(input_size, output_size, bias, None, **tp)
        self._make_params(output_size, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        param.data.copy_(loaded_weight)


class ColumnParallelLinear(LinearBase):
    """``y = x W^T`` with W's output rows split: rank r holds rows ``[r*n, (r+1)*n)``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **tp: Unpack[TPArgs]):
        super().__init__(input_size, output_size, bias, 0, **tp)
        self.output_size_per_partition = divide(output_size, self.tp_size, "output_size")
        self._make_params(self.output_size_per_partition, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard_size = param.data.size(0)
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers on the same input, fused (``gate_proj`` and ``up_proj``).

    The local weight is ``[gate shard; up shard]``: each rank keeps its slice of *each* part, so
    the activation that follows can split the output in two without communication.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **tp: Unpack[TPArgs]):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, **tp)
        for size in self.output_sizes:
            divide(size, self.tp_size, "each of output_sizes")

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
    ) -> None:
        # The shard id is optional only so that this still overrides ColumnParallelLinear's
        # two-argument loader; a fused weight cannot be loaded without naming its part.
        if loaded_shard_id is None:
            raise ValueError("loaded_shard_id must be the index of a part of output_sizes, got None")
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        target = param.data.narrow(0, shard_offset, shard_size)
        target.copy_(loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size))


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection; each rank holds its own heads of q, k and v.

    Needs ``total_num_heads`` and ``total_num_kv_heads`` divisible by ``tp_size`` (vLLM also
    replicates KV heads when ``tp_size`` exceeds them; left out here).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        **tp: Unpack[TPArgs],
    ):
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = tp.get("tp_size", 1)
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias, **tp)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None
    ) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        # Optional only to override ColumnParallelLinear's loader (as in MergedColumnParallelLinear).
        if loaded_shard_id not in offsets:
            raise ValueError(f"loaded_shard_id must be 'q', 'k' or 'v', got {loaded_shard_id!r}")
        shard_offset, shard_size = offsets[loaded_shard_id]
        target = param.data.narrow(0, shard_offset, shard_size)
        target.copy_(loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size))


class RowParallelLinear(LinearBase):
    """``y = x W^T`` with W's input columns split; the partial sums are all-reduced.

    The bias is added once (by rank 0) so the all-reduce does not multiply it by ``tp_size``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **tp: Unpack[TPArgs]):
        super().__init__(input_size, output_size, bias, 1, **tp)
        self.input_size_per_partition = divide(input_size, self.tp_size, "input_size")
        self._make_params(output_size, self.input_size_per_partition, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is not split
            param.data.copy_(loaded_weight)
            return
        shard_size = param.data.size(1)
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * shard_size, shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y
