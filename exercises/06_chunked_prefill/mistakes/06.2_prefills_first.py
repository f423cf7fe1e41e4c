def _running_order(self):
    """Serves prefilling requests first, so a long prompt's chunks starve the decodes behind it."""
    return [r for r in self.running if not r.is_decoding] + [r for r in self.running if r.is_decoding]
