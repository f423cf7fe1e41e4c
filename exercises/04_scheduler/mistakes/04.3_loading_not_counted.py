from scheduler import RequestStatus


def _schedule_waiting(self, out, budget):
    """Counts only self.running against max_num_seqs: requests loading from the pool hold seats too."""
    scheduled = []
    while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
        req = self.waiting.peek()
        remote = self._start_remote_load(req)
        if remote is None:
            break
        if remote:
            continue
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
