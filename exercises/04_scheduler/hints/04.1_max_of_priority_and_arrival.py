def _select_victim(self):
    """FCFS: the end of self.running; priority: the max of (priority, arrival_time) scanning reversed(self.running)."""
    if self.policy == "fcfs":
        return self.running[-1]
    return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
