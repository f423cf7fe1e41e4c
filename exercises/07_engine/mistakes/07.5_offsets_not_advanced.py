from functools import partial


def update(self, all_token_ids):
    """Appends the new text but never moves its offsets, so the next update appends it again."""
    if self.tokenizer is None:
        return
    decode = partial(self.tokenizer.decode, skip_special_tokens=True)
    # One sequence of ids decodes to one string (the stubs also allow a batch's list).
    prefix = str(decode(all_token_ids[self.prefix_offset : self.read_offset]))
    full = str(decode(all_token_ids[self.prefix_offset :]))
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        self.text += full[len(prefix) :]
