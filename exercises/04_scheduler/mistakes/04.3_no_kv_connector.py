from scheduler import RequestStatus


def _schedule_waiting(self, out, budget):
    """Never asks the KV connector: prompt blocks a global pool holds are recomputed."""
    scheduled = []
    while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
        req = self.waiting.peek()
        num_new = self._admit(req, budget)
        if num_new == 0:
            break
        self.waiting.pop()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduled.append(req)
        self._record(out, req, num_new)
        budget -= num_new
    return scheduled, budget
