def from_scheduler_output(cls, out):
    """Marks every row as sampling, even a prompt chunk that ends mid-prompt and must not emit a token."""
    info = cls()
    for req in out.scheduled_requests:
        rid = req.request_id
        info.add_row(
            rid,
            out.input_token_ids(req),
            out.num_computed_tokens[rid],
            req.block_table,
            True,
            len(out.scheduled_spec_decode_tokens.get(rid, ())),
            req.is_decoding,
        )
    return info
