import torch


def apply_grammar_bitmask(logits, grammar_output, request_ids, num_rows):
    """Scatters the masks into an all-zero mask for every row: rows without a constraint lose every token."""
    starts, row = {}, 0
    for rid, n in zip(request_ids, num_rows):
        starts[rid], row = row, row + n
    full = torch.zeros((logits.shape[0], grammar_output.bitmask.shape[1]), dtype=torch.int32)
    mask_row = 0
    for rid, n in zip(grammar_output.request_ids, grammar_output.num_rows):
        for j in range(n):
            full[starts[rid] + j] = grammar_output.bitmask[mask_row + j]
        mask_row += n
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((full.unsqueeze(-1) >> shifts) & 1).reshape(logits.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))
