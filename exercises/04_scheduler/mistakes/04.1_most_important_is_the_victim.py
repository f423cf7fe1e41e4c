def _select_victim(self):
    """Reads a lower priority value as less important, so the most important request is preempted."""
    if self.policy == "priority":
        return min(self.running, key=lambda r: (r.priority, r.arrival_time))
    return self.running[-1]
