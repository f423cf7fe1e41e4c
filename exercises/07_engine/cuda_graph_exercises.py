"""Exercises 07.T2a, 07.T2b of 07_engine: your versions of vllm_from_scratch/cuda_graph.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch

from attention_backends import AttentionMetadata


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, 16, 32, ... up to ``min(max_num_seqs, 512)``,
    always including that maximum itself.

    Hint: nano-vllm's: of 1, 2, 4, 8, 16, 32, 48, ... (every 16 from 16 on), those below
    min(max_num_seqs, 512), then that maximum itself; a max_num_seqs that is not an int >= 1 is
    a ValueError.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.T2a
    """
    raise NotImplementedError(
        "Exercise 07.T2a: implement capture_batch_sizes — see 07_engine/topics/cuda_graphs.md#exercises"
    )


def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
    """Replay the decode forward of ``n`` requests; returns their ``[n, hidden]`` states.

    The returned tensor is a view of the graph's output buffer, valid until the next replay.

    Becomes ``CUDAGraphRunner.run`` (a method: ``self`` is the CUDAGraphRunner). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Pick the smallest captured size >= n; fill the static buffers (pad rows: slot -1,
    context length 1), replay, and return the first n rows of the output.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.T2b
    """
    raise NotImplementedError(
        "Exercise 07.T2b: implement CUDAGraphRunner.run — see 07_engine/topics/cuda_graphs.md#exercises"
    )
