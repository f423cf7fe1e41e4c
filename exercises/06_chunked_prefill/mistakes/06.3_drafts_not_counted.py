def from_scheduler_output(cls, out):
    """Leaves out each request's draft count, so the verify rows of a speculative request are not sampled."""
    info = cls()
    for req in out.scheduled_requests:
        rid = req.request_id
        info.add_row(
            rid,
            out.input_token_ids(req),
            out.num_computed_tokens[rid],
            req.block_table,
            out.produces_token(req),
            0,
            req.is_decoding,
        )
    return info
