"""Exercise 07.M1 of 07_engine: your versions of vllm_from_scratch/models/minicpm.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch

from attention_backends import AttentionMetadata
from vllm_from_scratch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def forward(
    self,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    attn_metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniCPM's decoder layer: Llama's, with each residual branch scaled for µP

    Becomes ``MiniCPMDecoderLayer.forward`` (a method: ``self`` is the MiniCPMDecoderLayer).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Llama's layer (LlamaDecoderLayer.forward): input norm (adding the residual when there
    is one), attention, post-attention norm adding the residual, MLP. Multiply the attention's
    and the MLP's outputs by self.branch_scale (scale_depth / sqrt(num_hidden_layers)) before
    the fused norms add them to the residual stream.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.M1
    """
    raise NotImplementedError(
        "Exercise 07.M1: implement MiniCPMDecoderLayer.forward — see 07_engine/topics/adding_a_model.md#exercises"
    )
