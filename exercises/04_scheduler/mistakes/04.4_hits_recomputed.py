def _admit(self, req, budget):
    """Attaches the prefix hits but schedules the whole prompt from position 0, recomputing them."""
    computed = self.block_manager.get_computed_blocks(req)
    num_new = self._num_new_tokens(req, 0, budget)
    if num_new == 0 or not self.block_manager.allocate_slots(req, num_new, computed):
        return 0
    req.num_computed_tokens = 0
    if req.num_preemptions == 0:
        req.num_cached_tokens = len(computed) * self.block_size
    return num_new
