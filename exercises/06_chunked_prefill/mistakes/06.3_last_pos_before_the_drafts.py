def from_scheduler_output(cls, out):
    """Puts a speculative row's last_pos on its last known token, before its drafts: their positions go unscored."""
    info = cls()
    for req in out.scheduled_requests:
        rid = req.request_id
        num_spec = len(out.scheduled_spec_decode_tokens.get(rid, ()))
        info.add_row(
            rid, out.input_token_ids(req), out.num_computed_tokens[rid], req.block_table, out.produces_token(req),
            num_spec, req.is_decoding,
        )  # fmt: skip
        if info.last_pos[-1] >= 0:
            info.last_pos[-1] -= num_spec
    return info
