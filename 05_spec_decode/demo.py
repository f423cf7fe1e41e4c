"""Chapter 05 demo: speculative decoding that keeps the target distribution, then real drafts.

1. The rejection sampler on a toy vocabulary: every emitted position follows the target p,
   the first-position acceptance rate is sum(min(p, q)), and torch and Triton agree exactly.
2. The default model (SmolLM2-135M-Instruct, via transformers) verifying n-gram drafts on a
   prompt it has to copy: acceptance, tokens per target forward, wall-clock speed-up, and the
   check that the greedy output did not change.
3. The same with a draft model: the first layers of the default model saved as a checkpoint.

    python 05_spec_decode/demo.py
    python 05_spec_decode/demo.py --trace spec.jsonl   # n-gram drafts verified in the real engine, traced
"""

from __future__ import annotations

import argparse
import os

import torch

# Part 1 runs the Triton sampler; without a GPU only Triton's interpreter can. Triton reads this
# variable when a kernel is defined, i.e. when its module is imported, so it must be set here,
# before the imports below; the book's modules only read it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_spec_decode import WORKLOADS, chat_prompt_ids, timed_generate  # noqa: E402
from rejection_sampler_triton import rejection_sample_triton  # noqa: E402
from spec_decode import (  # noqa: E402
    RejectionNoise,
    num_accepted_tokens,
    rejection_sample,
    sample_rejection_noise,
    speculative_generate,
)
from triton_setup import KERNEL_DEVICE  # noqa: E402
from vllm_from_scratch.tools.viz import add_trace_argument  # noqa: E402


def toy_sampler(num_rows: int, seed: int) -> None:
    print(f"1) rejection sampler, vocab 6, k=2, {num_rows:,} independent steps")
    g = torch.Generator().manual_seed(seed)
    V, K = 6, 2
    p = torch.softmax(torch.randn(K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    draft = torch.stack([torch.multinomial(q[j], num_rows, True, generator=g) for j in range(K)], 1)
    out = rejection_sample(draft, q.expand(num_rows, K, V), p.expand(num_rows, K + 1, V), g)
    print("   pos  target p                          emitted histogram                 TV")
    for j in range(K + 1):
        tokens = out[:, j][out[:, j] >= 0]
        hist = torch.bincount(tokens, minlength=V).float() / tokens.numel()
        tv = 0.5 * (hist - p[j]).abs().sum().item()
        fmt = " ".join(f"{x:.3f}" for x in p[j].tolist())
        print(f"   {j}    {fmt}   {' '.join(f'{x:.3f}' for x in hist.tolist())}   {tv:.4f}")
    measured = (num_accepted_tokens(out) >= 1).float().mean().item()
    print(
        f"   acceptance at position 0: measured {measured:.4f}, "
        f"sum(min(p, q)) = {torch.minimum(p[0], q[0]).sum().item():.4f}; "
        f"exact-match verification would accept sum(p*q) = {(p[0] * q[0]).sum().item():.4f}"
    )
    small = slice(0, 8)
    noise = sample_rejection_noise(8, K, V, generator=g)
    a = rejection_sample(draft[small], q.expand(8, K, V), p.expand(8, K + 1, V), noise=noise)
    # The kernel runs where it can: CPU tensors in the interpreter, CUDA tensors compiled.
    dev = KERNEL_DEVICE
    on_dev = RejectionNoise(noise.uniform.to(dev), noise.exponential.to(dev))
    b = rejection_sample_triton(
        draft[small].to(dev), q.expand(8, K, V).to(dev), p.expand(8, K + 1, V).to(dev), noise=on_dev
    ).cpu()
    print(f"   torch vs Triton on 8 requests, same noise: identical = {torch.equal(a, b)}")
    print(f"   first rows (accepted drafts, then recovered/bonus, then -1): {a[:3].tolist()}")


def compare(name: str, target, proposer, prompt, max_new: int, k: int, baseline) -> None:
    tokens, stats, secs = timed_generate(target, proposer, prompt, max_new, k)
    base_tokens, base_secs = baseline
    print(
        f"   {name:<22} k={k}  acceptance {stats.acceptance_rate:5.1%}  "
        f"tokens/forward {stats.tokens_per_step:4.2f}  {secs:5.2f} s  "
        f"speed-up {base_secs / secs:4.2f}x  same output: {tokens == base_tokens}"
    )


def real_models(max_new: int, k: int, draft_layers: int, draft_tokens: int) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from proposers import DraftModelProposer, HFCausalLM, NgramProposer, make_truncated_draft
    from vllm_from_scratch.default_model import default_model_dir

    hf_logging.set_verbosity_error()
    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = HFCausalLM(model_dir)
    prompt = chat_prompt_ids(tokenizer, WORKLOADS["copy"])
    print(
        f"\n2) SmolLM2-135M float32 target, greedy, {len(prompt)}-token prompt that asks for "
        f"a copy, {max_new} new tokens"
    )
    speculative_generate(target, None, prompt, 4)  # warm-up
    base_tokens, _, base_secs = timed_generate(target, None, prompt, max_new, 0)
    baseline = (base_tokens, base_secs)
    print(
        f"   plain greedy            1 token/forward  {baseline[1]:5.2f} s   "
        f"text: {tokenizer.decode(base_tokens[:24])!r}..."
    )
    compare("n-gram (1..4)", target, NgramProposer(1, 4), prompt, max_new, k, baseline)

    draft_dir = make_truncated_draft(model_dir, draft_layers, f"{model_dir}-first{draft_layers}layers")
    print(
        f"\n3) draft model = first {draft_layers} of 30 layers of the same model "
        f"({os.path.basename(draft_dir)}), {draft_tokens} new tokens"
    )
    # A shorter run keeps the demo quick: the draft mostly adds cost (see README).
    base_short = (baseline[0][:draft_tokens], timed_generate(target, None, prompt, draft_tokens, 0)[2])
    compare(
        f"draft ({draft_layers} layers)", target, DraftModelProposer(draft_dir), prompt, draft_tokens, 2, base_short
    )
    print(
        "   an early exit of a 30-layer model rarely agrees with the full model: the draft\n"
        "   costs forwards and buys almost no accepted tokens, so here it does not pay."
    )


def trace(path: str) -> None:
    """``--trace``: n-gram drafts (k=4) in the real engine, on the default model and the prompt
    it has to copy: each verify step shows how many drafts the target accepted."""
    from vllm_from_scratch.tools.viz import Arrival, demo_trace

    demo_trace(
        path,
        [Arrival(WORKLOADS["copy"], 48)],
        num_kvcache_blocks=32,
        max_model_len=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="toy speculative steps")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--k", type=int, default=4, help="n-gram drafts per step")
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--draft-tokens", type=int, default=8, help="new tokens for the draft-model part")
    parser.add_argument("--toy-only", action="store_true", help="skip the real-model parts")
    parser.add_argument("--seed", type=int, default=0)
    add_trace_argument(parser)
    args = parser.parse_args()
    if args.trace:
        trace(args.trace)
        return
    torch.manual_seed(args.seed)
    toy_sampler(args.rows, args.seed)
    if not args.toy_only:
        real_models(args.max_new_tokens, args.k, args.draft_layers, args.draft_tokens)


if __name__ == "__main__":
    main()
