def check_supported_completion(self):
    """Skips the shared checks, so logprobs, echo, best_of and n pass silently and are ignored."""
