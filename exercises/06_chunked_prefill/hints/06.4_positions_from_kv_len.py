import torch

from attention_backends import AttentionMetadata
from chunked_prefill import BatchInputs
from kv_cache import build_slot_mapping


def build_batch_inputs(info, block_size, device="cpu"):
    """cu_seqlens_q: 0 then the running sum of chunk lengths; positions from kv_len; seq_lens_k = kv_len + chunk_len."""
    if not info.ids:
        raise ValueError("info describes an empty batch")
    cu, positions, seq_ids = [0], [], []
    for row, (n, kv_len) in enumerate(zip(info.chunk_len, info.kv_len)):
        cu.append(cu[-1] + n)
        positions += range(kv_len, kv_len + n)
        seq_ids += [row] * n
    width = max(len(t) for t in info.block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in info.block_tables], dtype=torch.int32)
    positions_t = torch.tensor(positions, dtype=torch.long)
    seq_lens_k = torch.tensor([k + n for k, n in zip(info.kv_len, info.chunk_len)], dtype=torch.int32)
    return BatchInputs(
        input_ids=torch.tensor(info.merge_prompt, dtype=torch.long).to(device),
        positions=positions_t.to(device),
        attn_metadata=AttentionMetadata(
            slot_mapping=build_slot_mapping(tables, positions_t, block_size, torch.tensor(seq_ids)).to(device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(device),
            seq_lens_k=seq_lens_k.to(device),
            block_tables=tables.to(device),
            max_seqlen_q=max(info.chunk_len),
            max_seqlen_k=int(seq_lens_k.max()),
        ),
        logits_indices=torch.tensor(info.logits_indices, dtype=torch.long).to(device),
    )
