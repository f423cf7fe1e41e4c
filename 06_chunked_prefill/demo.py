"""Chunked prefill on a toy transformer: watch a long prompt go through in pieces.

Two requests are decoding when a 40-token prompt arrives. Each line is one step of the
``ChunkedPrefillScheduler`` (token budget 8): the batch as ``SchedulerInfo`` describes it
(``D`` decode rows, ``P`` prefill chunks with their ``kv_len``/``chunk_len``, ``last_pos = -1``
when the chunk samples nothing). The same requests then run through chapter 04's scheduler
(whole prompts), and the demo checks that both produce the same tokens, and that every sampled
row's logits equal a plain dense forward of the whole sequence.

    python 06_chunked_prefill/demo.py
    python 06_chunked_prefill/demo.py --budget 16 --threshold 4
    python 06_chunked_prefill/demo.py --trace chunks.jsonl   # the real engine on the default model, traced
"""

from __future__ import annotations

import argparse

import torch

from chunked_prefill import ChunkedPrefillScheduler, SchedulerInfo
from chunked_toy_model import ToyRunner, ToyTransformer
from scheduler import Request, Scheduler
from vllm_from_scratch.tools.viz import add_trace_argument

BS = 4


def make_requests() -> list[Request]:
    return [
        Request("d1", [5, 6, 7], max_tokens=14, block_size=BS),
        Request("d2", [8, 9, 10, 11, 12], max_tokens=14, block_size=BS),
        Request("long", [(11 * i) % 120 + 1 for i in range(40)], max_tokens=3, block_size=BS),
    ]


def run(sched, model, verbose: bool) -> tuple[dict, float]:
    runner = ToyRunner(model, sched.block_manager.num_blocks, BS)
    reqs = make_requests()
    for r in reqs[:2]:
        sched.add_request(r)
    step, max_err = 0, 0.0
    while sched.has_requests() or step <= 2:
        if step == 2:
            sched.add_request(reqs[2])
        out = sched.schedule()
        info = SchedulerInfo.from_scheduler_output(out)
        sampled = runner.execute(out)
        for rid, logits in runner.last_logits.items():
            r = sched.requests[rid]
            max_err = max(max_err, (logits[-1] - model.forward_dense(r.token_ids)[-1]).abs().max().item())
        if verbose:
            rows = []
            for rid, dec, kv, n, last in zip(info.ids, info.is_decoding, info.kv_len, info.chunk_len, info.last_pos):
                rows.append(f"D {rid}" if dec else f"P {rid} kv_len={kv} chunk_len={n} last_pos={last}")
            print(f"{step:>4} | {len(info.merge_prompt):>2} tokens | " + "; ".join(rows))
        sched.update_from_output(out, sampled)
        step += 1
    assert sched.block_manager.all_blocks_free()
    return {r.request_id: r.completion_token_ids for r in reqs}, max_err


def trace(path: str) -> None:
    """``--trace``: the same story in the real engine. Two chat requests on the default model
    are decoding when a prompt of about 200 tokens arrives; with a budget of 48 tokens a step,
    it goes through in chunks beside their decodes."""
    from vllm_from_scratch.tools.viz import Arrival, demo_trace

    long = "Summarize this: " + " ".join(
        ["The engine schedules tokens, not requests, and every step has a budget."] * 12
    )
    demo_trace(
        path,
        [Arrival("Count from one to twenty.", 30), Arrival("Name the days of the week.", 30), Arrival(long, 4, step=3)],
        num_kvcache_blocks=48,
        max_num_batched_tokens=48,
        max_model_len=512,
        enable_prefix_caching=False,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=8, help="max_num_batched_tokens of the chunked scheduler")
    p.add_argument("--threshold", type=int, default=0, help="long_prefill_token_threshold (0: none)")
    add_trace_argument(p)
    args = p.parse_args(argv)
    if args.trace:
        trace(args.trace)
        return

    torch.manual_seed(0)
    model = ToyTransformer(vocab_size=128, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2)
    print(
        f"ChunkedPrefillScheduler(max_num_batched_tokens={args.budget}, "
        f"long_prefill_token_threshold={args.threshold or None}), block size {BS}"
    )
    print("step | batch    | rows (D = decode, P = prefill chunk)")
    chunked, err_c = run(
        ChunkedPrefillScheduler(4, args.budget, 64, block_size=BS, long_prefill_token_threshold=args.threshold),
        model,
        True,
    )
    whole, err_w = run(Scheduler(4, 64, 64, block_size=BS), model, False)
    print("\nrequest  tokens (chunked)                          same as whole-prompt scheduling")
    for rid, toks in chunked.items():
        print(f"{rid:>7}  {str(toks):<40}  {toks == whole[rid]}")
    print(f"\nlargest |logit - dense reference|: chunked {err_c:.1e}, whole {err_w:.1e}")


if __name__ == "__main__":
    main()
