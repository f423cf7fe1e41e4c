def check_supported_completion(self):
    """Skips the shared checks, so best_of, suffix and prompt_embeds pass silently and are ignored."""
