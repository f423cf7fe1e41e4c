import torch


def build_slot_mapping(block_tables, positions, block_size, seq_ids=None):
    """Without seq_ids, reads every position through the first row's table instead of row i for position i."""
    positions = positions.long()
    valid = positions >= 0
    safe = positions.clamp(min=0)
    if bool((safe[valid] // block_size >= block_tables.shape[1]).any()):
        raise ValueError("a position lies past its sequence's block table")
    rows = torch.zeros_like(safe) if seq_ids is None else seq_ids.long()
    slots = block_tables.long()[rows, safe // block_size] * block_size + safe % block_size
    return torch.where(valid, slots, torch.full_like(slots, -1))
