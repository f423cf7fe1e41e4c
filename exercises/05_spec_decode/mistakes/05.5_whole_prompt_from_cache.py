import torch

from proposers import common_prefix_len


def get_logits(self, token_ids, num_logits=1, slot=0):
    """Reuses the whole common prefix, so when every token is cached no position is left to compute logits at."""
    ids = list(token_ids)
    if not 1 <= num_logits <= len(ids):
        raise ValueError(f"num_logits must be in [1, len(token_ids)={len(ids)}], got {num_logits}")
    cache, cached_ids = self._caches.get(slot, (None, []))
    start = common_prefix_len(cached_ids, ids)
    if cache is None or start == 0:
        cache = None
    else:
        cache.crop(start - cache.get_seq_length())
    inp = torch.tensor([ids[start:]], dtype=torch.long, device=self.device)
    out = self.model(input_ids=inp, past_key_values=cache, use_cache=True, logits_to_keep=num_logits)
    self._caches[slot] = (out.past_key_values, ids)
    self.num_forwards += 1
    self.num_tokens_computed += len(ids) - start
    return out.logits[0, -num_logits:].float()
