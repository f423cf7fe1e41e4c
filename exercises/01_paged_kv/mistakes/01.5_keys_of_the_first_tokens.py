from store_kvcache import _check_args


def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping):
    """Drops the -1 slots but keeps the first keys, so after a skipped token every key lands one slot early."""
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    slots = slot_mapping[slot_mapping >= 0].long()
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())} but the cache has {num_slots} slots")
    n = slots.numel()
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slots, key[:n])
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slots, value[:n])
