from scheduler import RequestStatus


def _preempt(self, req):
    """Frees the blocks but keeps num_computed_tokens, as if the freed K/V were still there."""
    self.running.remove(req)
    self.block_manager.free(req)
    req.spec_token_ids = []
    req.status = RequestStatus.PREEMPTED
    req.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.add_preempted(req)
