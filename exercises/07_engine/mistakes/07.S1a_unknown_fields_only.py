from vllm_from_scratch.openai_protocol import APIError


def check_supported_sampling(self):
    """Refuses only fields no API defines, so a known field the engine ignores (length_penalty) is dropped silently."""
    for name in self.model_extra or {}:
        if name not in self.KNOWN_FIELDS:
            raise APIError(f"unknown field: {name}", param=name, code="unknown_field")
    if self.stream_options is not None and not self.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
