from vllm_from_scratch.openai_protocol import APIError


def check_supported_sampling(self):
    """Accepts presence and frequency penalties it cannot apply, silently returning unpenalized text."""
    if self.n != 1:
        raise APIError(f"n={self.n} is not supported: this server returns one choice (n=1)", param="n")

    if self.logit_bias:
        raise APIError("logit_bias is not supported by this engine", param="logit_bias")
    if self.stream_options is not None and not self.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
