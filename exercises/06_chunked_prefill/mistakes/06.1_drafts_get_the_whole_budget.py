def _num_new_tokens(self, req, num_computed, budget):
    """Gives the drafts the whole budget, not what the chunk left of it: a decode with drafts overruns the step."""
    num_new = req.num_tokens - num_computed
    if self.long_prefill_token_threshold:
        num_new = min(num_new, self.long_prefill_token_threshold)
    num_new = min(num_new, budget)
    return num_new + self._num_spec_tokens(req, num_computed, num_new, budget)
