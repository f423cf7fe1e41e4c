import torch

from store_kvcache import _check_args


def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping):
    """Chains two indexings, k_cache[blocks][offsets] = key: the first one returns a copy, the cache is untouched."""
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping.long()[keep]
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    rows = torch.arange(len(slots))
    k_cache[blocks][rows, offsets] = key[keep]
    v_cache[blocks][rows, offsets] = value[keep]
