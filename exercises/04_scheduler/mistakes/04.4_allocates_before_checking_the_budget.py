def _admit(self, req, budget):
    """Allocates the blocks of the whole prompt even when it does not fit the budget, and never gives them back."""
    computed = self.block_manager.get_computed_blocks(req)
    num_hit_tokens = len(computed) * self.block_size
    if not self.block_manager.allocate_slots(req, req.num_tokens - num_hit_tokens, computed):
        return 0
    num_new = self._num_new_tokens(req, num_hit_tokens, budget)
    if num_new == 0:
        return 0
    req.num_computed_tokens = num_hit_tokens
    if req.num_preemptions == 0:
        req.num_cached_tokens = num_hit_tokens
    return num_new
