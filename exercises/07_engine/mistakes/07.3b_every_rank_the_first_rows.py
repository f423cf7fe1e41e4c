def merged_weight_loader(self, param, loaded_weight, loaded_shard_id=None):
    """Copies the first rows of each part on every rank, as if tp_size were 1."""
    if loaded_shard_id is None:
        raise ValueError("loaded_shard_id must be the index of a part of output_sizes, got None")
    shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
    shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
    target = param.data.narrow(0, shard_offset, shard_size)
    target.copy_(loaded_weight.narrow(0, 0, shard_size))
