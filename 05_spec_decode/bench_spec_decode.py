"""Benchmark: what speculative decoding buys on this machine, and when it does not pay.

Target: the default model (SmolLM2-135M-Instruct, float32, transformers, batch 1, greedy).
Proposers: none (plain decoding through the same code path), n-gram prompt lookup at several
k, and a draft model made of the target's first layers. Two workloads: a prompt the model has
to copy (n-gram friendly) and an open-ended story (nothing to copy). For each row: acceptance
rate, tokens per target forward, wall time (best of ``--repeats``), speed-up over plain
decoding and whether the greedy output is unchanged. A cost model section times one target
forward over 1 and k+1 tokens and one draft step, which predicts the speed-up as
``E[tokens per step] / (t_verify(k+1) / t_target(1) + k * t_draft / t_target(1))``.

    python 05_spec_decode/bench_spec_decode.py --max-new-tokens 64 --repeats 2
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from machine import add_quiet_arg, check_quiet, load_average, machine_line
from proposers import DraftModelProposer, HFCausalLM, NgramProposer, make_truncated_draft
from spec_decode import speculative_generate

COPY_TEXT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
WORKLOADS = {
    "copy": "Rewrite this Python code, adding a docstring to every function:\n\n" + COPY_TEXT,
    "open": "Write a short story about a robot who learns to paint.",
}


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a user turn in the model's chat template."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def timed_generate(target: HFCausalLM, proposer, prompt: list[int], max_new: int, k: int, repeats: int = 1):
    """Best wall time of ``repeats`` runs (caches reset each time); returns tokens, stats, s."""
    best = float("inf")
    for _ in range(repeats):
        target.reset()
        if isinstance(proposer, DraftModelProposer):
            proposer.lm.reset()
        t0 = time.perf_counter()
        tokens, stats = speculative_generate(target, proposer, prompt, max_new, k)
        best = min(best, time.perf_counter() - t0)
    return tokens, stats, best


def _forward_ms(lm: HFCausalLM, prompt: list[int], n: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        lm.reset()
        lm.get_logits(prompt, 1)
        t0 = time.perf_counter()
        lm.get_logits(prompt + [42] * n, n)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def cost_model(target: HFCausalLM, draft: HFCausalLM, prompt: list[int], ks: list[int]) -> None:
    t1 = _forward_ms(target, prompt, 1)
    td = _forward_ms(draft, prompt, 1)
    print(f"\ncost model (best of 5): target forward 1 token {t1:.1f} ms, draft step {td:.1f} ms (c = {td / t1:.2f})")
    print("k  | target forward over k+1 tokens | tokens/step needed to break even, n-gram (free) | draft model")
    for k in ks:
        tv = _forward_ms(target, prompt, k + 1)
        print(
            f"{k:<2} | {tv:6.1f} ms ({tv / t1:.2f}x)             | {tv / t1:5.2f}"
            f"                                | {(tv + k * td) / t1:5.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="n-gram k values")
    parser.add_argument("--draft-ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs per row; best time counts")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_quiet_arg(parser)
    args = parser.parse_args()
    check_quiet(args.refuse_busy)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from vllm_from_scratch.default_model import default_model_dir

    hf_logging.set_verbosity_error()
    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = HFCausalLM(model_dir)
    draft_dir = make_truncated_draft(model_dir, args.draft_layers, f"{model_dir}-first{args.draft_layers}layers")
    draft = DraftModelProposer(draft_dir)

    runs = [("none", None, 0)]
    runs += [("n-gram 1..4", NgramProposer(1, 4), k) for k in args.ks]
    runs += [(f"draft {args.draft_layers}/30 layers", draft, k) for k in args.draft_ks]
    rows = []
    with tqdm(total=len(args.workloads) * len(runs), desc="bench") as bar:
        for wl in args.workloads:
            prompt = chat_prompt_ids(tokenizer, WORKLOADS[wl])
            speculative_generate(target, None, prompt, 4)  # warm-up
            base_tokens, base_time = None, None
            for name, proposer, k in runs:
                tokens, stats, secs = timed_generate(target, proposer, prompt, args.max_new_tokens, k, args.repeats)
                if proposer is None:
                    base_tokens, base_time = tokens, secs
                rows.append((wl, name, k, stats, secs, base_time / secs, tokens == base_tokens))
                bar.update()

    print(
        f"\nSmolLM2-135M-Instruct float32 target, greedy, batch 1, {args.max_new_tokens} new "
        f"tokens\n{machine_line()}; load average {load_average()}"
    )
    print("workload | proposer            | k | acceptance | tokens/forward | time s | tok/s  | speed-up | same output")
    print("---------|---------------------|---|------------|----------------|--------|--------|----------|------------")
    for wl, name, k, stats, secs, speedup, same in rows:
        acc = f"{stats.acceptance_rate:6.1%}" if k else "     -"
        print(
            f"{wl:<8} | {name:<19} | {k} | {acc:>10} | {stats.tokens_per_step:14.2f} | "
            f"{secs:6.2f} | {args.max_new_tokens / secs:6.1f} | {speedup:7.2f}x | {same}"
        )
    cost_model(
        target, draft.lm, chat_prompt_ids(tokenizer, WORKLOADS["copy"]), sorted(set(args.ks) | set(args.draft_ks))
    )


if __name__ == "__main__":
    main()
