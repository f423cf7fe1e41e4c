from vllm_from_scratch.openai_protocol import APIError


def check_supported_completion(self):
    """Checks only the completion fields, skipping the shared sampling checks (n, penalties, logit_bias)."""

    if self.logprobs is not None:
        raise APIError("logprobs is not supported by this engine", param="logprobs")
    if self.echo:
        raise APIError("echo is not supported by this engine", param="echo")
    if self.best_of not in (None, 1):
        raise APIError(f"best_of={self.best_of} is not supported (only 1)", param="best_of")
    if self.suffix:
        raise APIError("suffix is not supported by this engine", param="suffix")
