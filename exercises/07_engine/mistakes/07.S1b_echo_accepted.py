from vllm_from_scratch.openai_protocol import APIError, CompletionRequest


def check_supported_completion(self):
    """Accepts echo, which this engine cannot honour, instead of refusing it with a 400."""
    super(CompletionRequest, self).check_supported()
    if self.logprobs is not None:
        raise APIError("logprobs is not supported by this engine", param="logprobs")

    if self.best_of not in (None, 1):
        raise APIError(f"best_of={self.best_of} is not supported (only 1)", param="best_of")
    if self.suffix:
        raise APIError("suffix is not supported by this engine", param="suffix")
