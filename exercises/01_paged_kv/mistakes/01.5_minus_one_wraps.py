from store_kvcache import _check_args


def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping):
    """Indexes with slot -1 as it stands: Python-style wrap-around writes padding into the last slot."""
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:])[slot_mapping.long()] = key
    v_cache.view(num_slots, *v_cache.shape[2:])[slot_mapping.long()] = value
