from block_manager import BlockManager


def _allocate_block(self):
    """Evicting forgets the hash but leaves the block's old token ids on it, for whatever it holds next."""
    block = BlockManager._allocate_block(self)
    if block.block_hash is not None:
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1
    return block
