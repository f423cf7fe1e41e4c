def _admit(self, req, budget):
    """Sets num_cached_tokens on every admission: a re-admitted request reports its own blocks as a cache saving."""
    computed = self.block_manager.get_computed_blocks(req)
    num_hit_tokens = len(computed) * self.block_size
    num_new = self._num_new_tokens(req, num_hit_tokens, budget)
    if num_new == 0 or not self.block_manager.allocate_slots(req, num_new, computed):
        return 0
    req.num_computed_tokens = num_hit_tokens
    req.num_cached_tokens = num_hit_tokens
    return num_new
