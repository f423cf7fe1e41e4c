import torch


def apply_grammar_bitmask(logits, grammar_output, request_ids, num_rows):
    """Reads each mask word's bits most significant first: token t is looked up at bit 31 - t % 32."""
    starts, row = {}, 0
    for rid, n in zip(request_ids, num_rows):
        starts[rid], row = row, row + n
    mask_row = 0
    vocab = logits.shape[1]
    shifts = torch.arange(31, -1, -1, dtype=torch.int32)
    for rid, n in zip(grammar_output.request_ids, grammar_output.num_rows):
        for j in range(n):
            words = grammar_output.bitmask[mask_row + j]
            allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:vocab].bool()
            logits[starts[rid] + j] = logits[starts[rid] + j].masked_fill(~allowed, float("-inf"))
        mask_row += n
