from vllm_from_scratch.openai_protocol import IDENTIFYING_FIELDS, REFUSAL_REASONS, APIError, engine_fields


def check_supported_sampling(self):
    """Refuses an explicit null for an unsupported field, which SDKs send for every field they do not set."""
    for name in self.model_extra or {}:
        if name not in self.KNOWN_FIELDS:
            raise APIError(f"unknown field: {name}", param=name, code="unknown_field")
    handled = set(type(self).model_fields) | engine_fields(self.KNOWN_FIELDS) | IDENTIFYING_FIELDS
    for name, value in self.given_fields().items():
        if name not in handled and value not in self.KNOWN_FIELDS[name]:
            reason = f"; {REFUSAL_REASONS[name]}" if name in REFUSAL_REASONS else ""
            raise APIError(
                f"not supported by this engine: {name}={value!r}{reason}", param=name, code="unsupported_field"
            )
    if self.stream_options is not None and not self.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
