from scheduler import RequestStatus


def _schedule_waiting(self, out, budget):
    """Lets smaller requests overtake a head that does not fit, which can starve the head forever."""
    scheduled = []
    for req in list(self.waiting):
        if budget <= 0 or len(self.running) + len(self.loading) >= self.max_num_seqs:
            break
        remote = self._start_remote_load(req) if req is self.waiting.peek() else False
        if remote is None:
            break
        if remote:
            continue
        num_new = self._admit(req, budget)
        if num_new == 0:
            continue
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduled.append(req)
        self._record(out, req, num_new)
        budget -= num_new
    return scheduled, budget
