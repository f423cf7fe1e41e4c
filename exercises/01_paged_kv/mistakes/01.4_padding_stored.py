import torch


def build_slot_mapping(block_tables, positions, block_size, seq_ids=None):
    """Clamps padding positions to 0 instead of mapping them to slot -1, so padding overwrites a real slot."""
    if seq_ids is None:
        seq_ids = torch.arange(positions.numel(), device=positions.device)
    pos = positions.long().clamp(min=0)
    if bool((pos // block_size >= block_tables.shape[1]).any()):
        raise ValueError("a position lies past its sequence's block table")
    return block_tables.long()[seq_ids.long(), pos // block_size] * block_size + pos % block_size
