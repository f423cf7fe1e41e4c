from scheduler import RequestStatus


def _preempt(self, req):
    """Requeues the victim without freeing its blocks: preemption frees no memory and leaks it."""
    self.running.remove(req)
    req.num_computed_tokens = 0
    req.spec_token_ids = []
    req.status = RequestStatus.PREEMPTED
    req.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.add_preempted(req)
