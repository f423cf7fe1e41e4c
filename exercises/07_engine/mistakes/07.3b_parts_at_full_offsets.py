def merged_weight_loader(self, param, loaded_weight, loaded_shard_id=None):
    """Places part i at sum(output_sizes[:i]), the full model's offset, not this rank's share of it."""
    if loaded_shard_id is None:
        raise ValueError("loaded_shard_id must be the index of a part of output_sizes, got None")
    shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
    shard_offset = sum(self.output_sizes[:loaded_shard_id])
    target = param.data.narrow(0, shard_offset, shard_size)
    target.copy_(loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size))
