import torch


def build_slot_mapping(block_tables, positions, block_size, seq_ids=None):
    """Assumes each sequence's blocks are contiguous: slot = block_tables[s, 0] * block_size + p."""
    if seq_ids is None:
        seq_ids = torch.arange(positions.numel(), device=positions.device)
    pos = positions.long()
    if bool((pos.clamp(min=0) // block_size >= block_tables.shape[1]).any()):
        raise ValueError("a position lies past its sequence's block table")
    slots = block_tables.long()[seq_ids.long(), 0] * block_size + pos
    return torch.where(pos >= 0, slots, torch.full_like(slots, -1))
