def _select_victim(self):
    """Preempts the request admitted first (running[0]), throwing away the most finished work."""
    if self.policy == "priority":
        return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
    return self.running[0]
