import torch


def apply_grammar_bitmask(logits, grammar_output, request_ids, num_rows):
    """Takes mask row k for the k-th masked request, as if each sampled one row (a request with drafts has several)."""
    starts, row = {}, 0
    for rid, n in zip(request_ids, num_rows):
        starts[rid], row = row, row + n
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32)
    for k, (rid, n) in enumerate(zip(grammar_output.request_ids, grammar_output.num_rows)):
        words = grammar_output.bitmask[k]
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:vocab].bool()
        for j in range(n):
            logits[starts[rid] + j] = logits[starts[rid] + j].masked_fill(~allowed, float("-inf"))
