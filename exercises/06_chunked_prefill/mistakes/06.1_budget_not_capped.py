def _num_new_tokens(self, req, num_computed, budget):
    """Caps the chunk by the threshold but not by the budget, so the step overruns max_num_batched_tokens."""
    num_new = req.num_tokens - num_computed
    if self.long_prefill_token_threshold:
        num_new = min(num_new, self.long_prefill_token_threshold)
    return num_new + self._num_spec_tokens(req, num_computed, num_new, max(0, budget - num_new))
