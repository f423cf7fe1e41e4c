from block_manager import BlockManager


def _allocate_block(self):
    """Clears the reused block's hash but leaves the map entry, so a later lookup finds a block holding other tokens."""
    block = BlockManager._allocate_block(self)
    if block.block_hash is not None:
        block.block_hash = None
        block.token_ids = ()
        self.num_evictions += 1
    return block
