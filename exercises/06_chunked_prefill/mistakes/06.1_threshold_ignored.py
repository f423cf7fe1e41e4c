def _num_new_tokens(self, req, num_computed, budget):
    """Ignores long_prefill_token_threshold, so one long prompt takes the whole budget every step."""
    num_new = req.num_tokens - num_computed
    num_new = min(num_new, budget)
    return num_new + self._num_spec_tokens(req, num_computed, num_new, budget - num_new)
