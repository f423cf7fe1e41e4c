from scheduler import RequestStatus


def _preempt(self, req):
    """Puts the victim at the back of the queue, behind requests that arrived after it."""
    self.running.remove(req)
    self.block_manager.free(req)
    req.num_computed_tokens = 0
    req.spec_token_ids = []
    req.status = RequestStatus.PREEMPTED
    req.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.add(req)
