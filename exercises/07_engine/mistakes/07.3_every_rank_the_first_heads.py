def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
    """Copies the first heads of each checkpoint tensor on every rank, as if tp_size were 1."""
    q_size = self.num_heads * self.head_size
    kv_size = self.num_kv_heads * self.head_size
    offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
    # Optional only to override ColumnParallelLinear's loader (as in MergedColumnParallelLinear).
    if loaded_shard_id not in offsets:
        raise ValueError(f"loaded_shard_id must be 'q', 'k' or 'v', got {loaded_shard_id!r}")
    shard_offset, shard_size = offsets[loaded_shard_id]
    target = param.data.narrow(0, shard_offset, shard_size)
    target.copy_(loaded_weight.narrow(0, 0, shard_size))
