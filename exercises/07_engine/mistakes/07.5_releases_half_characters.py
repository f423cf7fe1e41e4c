from functools import partial


def update(self, all_token_ids):
    """Releases text as soon as it grows, even when it ends in half a UTF-8 character (the replacement character)."""
    if self.tokenizer is None:
        return
    decode = partial(self.tokenizer.decode, skip_special_tokens=True)
    # One sequence of ids decodes to one string (the stubs also allow a batch's list).
    prefix = str(decode(all_token_ids[self.prefix_offset : self.read_offset]))
    full = str(decode(all_token_ids[self.prefix_offset :]))
    if len(full) > len(prefix):
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(all_token_ids)
