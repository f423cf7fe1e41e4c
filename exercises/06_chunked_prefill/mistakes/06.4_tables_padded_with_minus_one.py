import torch

from chunked_prefill import BatchInputs
from kv_cache import build_slot_mapping


def build_batch_inputs(info, block_size, device="cpu"):
    """Pads the block tables with -1, which a kernel reading a whole row takes as a block index."""
    if not info.ids:
        raise ValueError("info describes an empty batch")
    lens = torch.tensor(info.chunk_len, dtype=torch.int32)
    starts = torch.tensor(info.kv_len, dtype=torch.int32)
    cu_seqlens_q = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=cu_seqlens_q[1:])
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), lens.long())
    positions = torch.arange(int(cu_seqlens_q[-1])) - cu_seqlens_q[:-1][seq_ids] + starts[seq_ids]
    width = max(len(bt) for bt in info.block_tables)
    tables = torch.tensor([bt + [-1] * (width - len(bt)) for bt in info.block_tables], dtype=torch.int32)
    seq_lens_k = starts + lens
    return BatchInputs(
        input_ids=torch.tensor(info.merge_prompt, dtype=torch.long),
        positions=positions,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens_k=seq_lens_k,
        slot_mapping=build_slot_mapping(tables, positions, block_size, seq_ids),
        block_tables=tables,
        logits_indices=torch.tensor(info.logits_indices, dtype=torch.long),
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(seq_lens_k.max()),
    )
