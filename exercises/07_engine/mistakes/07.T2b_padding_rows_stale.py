def run(self, input_ids, positions, attn_metadata):
    """Leaves the padding rows as the last replay left them: a pad row writes K/V into a real slot."""
    n = input_ids.numel()
    bs = self.padded_batch_size(n)
    width = attn_metadata.block_tables.size(1)
    self.input_ids[:n] = input_ids
    self.positions[:n] = positions
    self.slot_mapping[:n] = attn_metadata.slot_mapping
    self.seq_lens_k[:n] = attn_metadata.seq_lens_k
    self.block_tables[:n, :width] = attn_metadata.block_tables
    # Clear what an earlier, wider batch left past this width: the context lengths mask those
    # columns anyway, but this way a replay depends on this batch alone.
    self.block_tables[:n, width:] = 0
    self.graphs[bs].replay()
    return self.hidden_states[:n]
