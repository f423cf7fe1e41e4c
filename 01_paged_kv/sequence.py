"""A sequence of tokens as the paged KV cache sees it.

This is the smallest thing the block manager needs to know about a request: its token ids, how
many of them already have their K/V in the cache (``num_computed_tokens``, vLLM V1's single
counter that makes prefill, chunked prefill, prefix hits and decode one mechanism), and the block
table that maps its logical blocks to physical ones. Chapter 04's ``Request`` extends it with a
status, a priority and stopping rules; the engine's requests are those.
"""

from __future__ import annotations

from collections.abc import Iterable


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers: ``cdiv(tokens, block_size)`` blocks hold them.

    Defined beside :class:`Sequence`, which counts its own blocks with it; ``block_manager``
    re-exports it, and later chapters import it from there (``from block_manager import cdiv``).
    """
    return -(-a // b)


class Sequence:
    """Token ids plus the paging state of one request.

    Args:
        token_ids: the prompt; generated tokens are appended with :meth:`append_token`.
        block_size: tokens per KV block; must equal the block manager's.
        cache_salt: optional per-tenant salt mixed into the first block's prefix-cache hash, so
            tenants never share cached KV (chapter 03).
    """

    def __init__(self, token_ids: Iterable[int], block_size: int = 16, cache_salt: str | None = None):
        self.token_ids: list[int] = list(token_ids)
        if not self.token_ids:
            raise ValueError("token_ids must not be empty")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V is already in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.block_table: list[int] = []  # logical block i lives in physical block block_table[i]
        self.cache_salt = cache_salt
        # Filled by a prefix-caching block manager (chapter 03): the chained hash of each full
        # block, and how many leading blocks of block_table it has registered by hash.
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token of the sequence."""
        return cdiv(self.num_tokens, self.block_size)

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i`` (the last one may be partial)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block index {i} out of range for {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
