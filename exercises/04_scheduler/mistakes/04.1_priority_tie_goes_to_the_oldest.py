def _select_victim(self):
    """Breaks a priority tie towards the earliest arrival, not the latest."""
    if self.policy == "priority":
        return max(self.running, key=lambda r: (r.priority, -r.arrival_time))
    return self.running[-1]
