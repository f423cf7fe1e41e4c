from vllm_from_scratch.openai_protocol import APIError


def check_supported_sampling(self):
    """Ignores n, so a request for several choices gets one without an error."""

    if self.presence_penalty or self.frequency_penalty:
        param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
        raise APIError(f"{param} is not supported by this engine", param=param)
    if self.logit_bias:
        raise APIError("logit_bias is not supported by this engine", param="logit_bias")
    if self.stream_options is not None and not self.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
