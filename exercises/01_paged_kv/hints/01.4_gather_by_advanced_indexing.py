import torch


def build_slot_mapping(block_tables, positions, block_size, seq_ids=None):
    """Gathers block_tables[seq_ids, positions // block_size]; negative positions: -1; past the table: ValueError."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if seq_ids is not None and seq_ids.shape != positions.shape:
        raise ValueError(f"seq_ids must have positions' shape {tuple(positions.shape)}")
    if seq_ids is None:
        if positions.numel() != block_tables.shape[0]:
            raise ValueError("positions must have one entry per block_tables row when seq_ids is None")
        seq_ids = torch.arange(positions.numel())
    positions = positions.long()
    padding = positions < 0
    kept = positions.clamp(min=0)
    if bool((kept[~padding] // block_size >= block_tables.shape[1]).any()):
        raise ValueError("a position lies past its sequence's block table")
    blocks = block_tables[seq_ids.long(), kept // block_size].long()
    return torch.where(padding, -1, blocks * block_size + kept % block_size)
