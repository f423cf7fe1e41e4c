"""A miniature engine instance for the global KV pool: real paged K/V, no real model.

``MiniEngine`` has what an engine brings to prefix caching — chapter 01's paged KV cache and
``store_kvcache``, chapter 03's prefix-caching block manager, a :class:`GlobalKVPool` — and a
``ToyKVModel`` in place of the transformer: deterministic K/V per layer that depend on the whole
prefix (as real K/V do), and a fixed query per layer, so attention over the cache can be compared
between engines. Run as a script it is one engine process of a two-process experiment:

    python 03_prefix_cache/kv_pool_peer.py --role publish --master 127.0.0.1:P \\
        --metadata http://127.0.0.1:Q/metadata --prompt-len 70 --out a.pt
    python 03_prefix_cache/kv_pool_peer.py --role fetch ... --out b.pt

Each writes a ``torch.save`` report: the attention output of the last prompt token over the
paged cache, the K/V of the prompt read back through its block table, and token counts.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from global_kv_pool import EmbeddedKVPool, GlobalKVPool, KVPoolBackend, MooncakeKVPool
from kv_cache import allocate_kv_cache
from paged_attention import paged_attention_decode
from prefix_block_manager import PrefixCachingBlockManager
from sequence import Sequence
from store_kvcache import store_kvcache


class ToyKVModel:
    """Deterministic K/V ``[layers, tokens, kv_heads, head_dim]`` that depend on the prefix.

    K/V of position ``p`` mix the token's embedding with the mean of the embeddings up to ``p``,
    so the same token after a different prefix has different K/V: exactly why a block's hash must
    chain its parent.
    """

    def __init__(
        self,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        vocab_size: int = 512,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        g = torch.Generator().manual_seed(seed)
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = (
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.dtype = dtype
        self.embed = torch.randn(2, num_layers, vocab_size, num_kv_heads, head_dim, generator=g)
        self.queries = torch.randn(num_layers, num_heads, head_dim, generator=g)

    def compute_kv(self, token_ids: list[int]) -> torch.Tensor:
        """``[2, layers, len(token_ids), kv_heads, head_dim]`` in the model's dtype."""
        e = self.embed[:, :, torch.tensor(token_ids)]
        prefix_mean = e.cumsum(dim=2) / torch.arange(1, len(token_ids) + 1).view(1, 1, -1, 1, 1)
        return (e + prefix_mean).to(self.dtype)


class MiniEngine:
    """Prefill prompts into a paged KV cache, reusing local prefix hits and the global pool.

    Args:
        pool: a :class:`GlobalKVPool` or ``None`` for a local-only engine.
        num_blocks / block_size: the paged cache.
        model: the :class:`ToyKVModel` (all engines sharing a pool must use the same one).
        reserved_blocks: blocks taken by a dummy sequence first, so two engines place the same
            prompt in different physical blocks.
    """

    def __init__(
        self,
        pool: GlobalKVPool | None = None,
        num_blocks: int = 64,
        block_size: int = 16,
        model: ToyKVModel | None = None,
        reserved_blocks: int = 0,
    ):
        self.pool = pool
        self.model = model or ToyKVModel()
        m = self.model
        self.block_manager = PrefixCachingBlockManager(num_blocks, block_size)
        self.kv_cache = allocate_kv_cache(m.num_layers, num_blocks, block_size, m.num_kv_heads, m.head_dim, m.dtype)
        self._reserved = None
        if reserved_blocks:
            self._reserved = Sequence([0] * (reserved_blocks * block_size), block_size)
            if not self.block_manager.allocate_slots(self._reserved, self._reserved.num_tokens):
                raise ValueError(f"reserved_blocks={reserved_blocks} does not fit in num_blocks={num_blocks}")
        self.tokens_from_local = self.tokens_from_pool = self.tokens_computed = 0

    def prefill(self, token_ids: list[int]) -> Sequence:
        """Admit a prompt, load what the caches have, compute and store the rest, publish."""
        bm = self.block_manager
        seq = Sequence(token_ids, bm.block_size)
        hits = bm.get_computed_blocks(seq)
        if not bm.allocate_slots(seq, seq.num_tokens - len(hits) * bm.block_size, hits):
            raise RuntimeError("out of KV blocks")
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * bm.block_size
        self.tokens_from_local += seq.num_computed_tokens
        if self.pool is not None:
            self.tokens_from_pool += self.pool.load_sequence(seq, bm, self.kv_cache)
        start = seq.num_computed_tokens
        kv = self.model.compute_kv(seq.token_ids)[:, :, start:]  # the toy model is cheap; a real one
        slots = torch.tensor(bm.slot_mapping(seq, start, seq.num_tokens))  # would only run [start:)
        for layer in range(self.model.num_layers):
            store_kvcache(kv[0, layer], kv[1, layer], self.kv_cache[0, layer], self.kv_cache[1, layer], slots)
        self.tokens_computed += seq.num_tokens - start
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        if self.pool is not None:
            self.pool.publish_sequence(seq, bm, self.kv_cache)
        return seq

    def attention(self, seq: Sequence) -> torch.Tensor:
        """``[layers, heads, head_dim]``: the last token's attention over the whole cached prompt."""
        block_tables = torch.tensor([seq.block_table], dtype=torch.int32)
        context_lens = torch.tensor([seq.num_tokens], dtype=torch.int32)
        m = self.model
        return torch.stack(
            [
                paged_attention_decode(
                    m.queries[layer][None].to(m.dtype),
                    self.kv_cache[0, layer],
                    self.kv_cache[1, layer],
                    block_tables,
                    context_lens,
                    m.head_dim**-0.5,
                )[0]
                for layer in range(m.num_layers)
            ]
        )

    def gather_kv(self, seq: Sequence) -> torch.Tensor:
        """The prompt's K/V ``[2, layers, tokens, kv_heads, head_dim]`` read through its block table."""
        slots = torch.tensor(self.block_manager.slot_mapping(seq, 0, seq.num_tokens))
        return self.kv_cache.flatten(2, 3)[:, :, slots]

    def finish(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def close(self) -> None:
        """Give back the reserved blocks; afterwards every block is free unless a prompt is live."""
        if self._reserved is not None:
            self.block_manager.free(self._reserved)
            self._reserved = None


def prompt_tokens(seed: int, length: int, vocab_size: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=g).tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--role",
        choices=["publish", "fetch"],
        required=True,
        help="publish: compute the prompt and publish its blocks; fetch: load them first",
    )
    ap.add_argument("--backend", choices=["mooncake", "embedded"], default="mooncake")
    ap.add_argument("--master", help="mooncake_master RPC address host:port")
    ap.add_argument("--metadata", help="Mooncake HTTP metadata URL http://host:port/metadata")
    ap.add_argument(
        "--segment-mb",
        type=int,
        default=32,
        help="memory this engine lends to the pool (0: store values in other segments)",
    )
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=70)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reserved-blocks", type=int, default=0, help="shift this engine's physical block ids")
    ap.add_argument(
        "--hold", action="store_true", help="after the work, print READY and keep the store open until stdin closes"
    )
    ap.add_argument("--out", required=True, help="where to torch.save the report")
    args = ap.parse_args(argv)

    if args.backend == "mooncake":
        if not (args.master and args.metadata):
            ap.error("--backend mooncake needs --master and --metadata")
        backend: KVPoolBackend = MooncakeKVPool(args.master, args.metadata, global_segment_size=args.segment_mb << 20)
    else:
        backend = EmbeddedKVPool()
    pool = GlobalKVPool(backend, namespace="toy-kv-model-seed0", block_size=args.block_size)
    engine = MiniEngine(pool, block_size=args.block_size, reserved_blocks=args.reserved_blocks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seq = engine.prefill(prompt_tokens(args.prompt_seed, args.prompt_len))
    torch.save(
        {
            "attention": engine.attention(seq),
            "kv": engine.gather_kv(seq).clone(),
            "block_table": list(seq.block_table),
            "tokens_from_pool": engine.tokens_from_pool,
            "tokens_computed": engine.tokens_computed,
            "published": pool.num_published,
            "warnings": [str(w.message) for w in caught],
        },
        args.out,
    )
    if args.hold:
        print("READY", flush=True)
        sys.stdin.read()
    engine.finish(seq)
    engine.close()
    backend.close()


if __name__ == "__main__":
    main()
