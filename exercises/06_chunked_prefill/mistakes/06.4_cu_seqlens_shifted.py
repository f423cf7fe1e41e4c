import torch

from chunked_prefill import BatchInputs, build_slot_mapping


def build_batch_inputs(info, block_size, device="cpu"):
    """Builds cu_seqlens_q as a plain cumulative sum without the leading 0: every row range shifts by one."""
    if not info.ids:
        raise ValueError("info describes an empty batch")
    lens = torch.tensor(info.chunk_len, dtype=torch.int32)
    starts = torch.tensor(info.kv_len, dtype=torch.int32)
    cu_seqlens_q = torch.cat([torch.cumsum(lens, 0, dtype=torch.int32), lens.sum().view(1).int()])
    # int64 repeats: with int32 ones torch 2.13's CPU repeat_interleave takes ~2.5 ms instead of ~10 us.
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), lens.long())
    positions = torch.arange(int(cu_seqlens_q[-1])) - cu_seqlens_q[:-1][seq_ids] + starts[seq_ids]
    width = max(len(bt) for bt in info.block_tables)
    tables = torch.tensor([bt + [0] * (width - len(bt)) for bt in info.block_tables], dtype=torch.int32)
    seq_lens_k = starts + lens
    slot_mapping = build_slot_mapping(tables, positions, block_size, seq_ids)

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return BatchInputs(
        input_ids=to(torch.tensor(info.merge_prompt, dtype=torch.long)),
        positions=to(positions),
        cu_seqlens_q=to(cu_seqlens_q),
        seq_lens_k=to(seq_lens_k),
        slot_mapping=to(slot_mapping),
        block_tables=to(tables),
        logits_indices=to(torch.tensor(info.logits_indices, dtype=torch.long)),
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(seq_lens_k.max()),
    )
