def _running_order(self):
    """Reorders self.running itself, so admission order is lost and preemption picks the wrong victim."""
    self.running.sort(key=lambda r: not r.is_decoding)
    return self.running
