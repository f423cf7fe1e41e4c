def _num_new_tokens(self, req, num_computed, budget):
    """Keeps chapter 04's all-or-nothing rule: a prompt longer than the budget never starts."""
    num_new = req.num_tokens - num_computed
    if self.long_prefill_token_threshold:
        num_new = min(num_new, self.long_prefill_token_threshold)
    if num_new > budget:
        return 0
    return num_new + self._num_spec_tokens(req, num_computed, num_new, budget - num_new)
