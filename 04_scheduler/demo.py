"""Watch the scheduler work, step by step, on a KV cache too small for its requests.

Four requests share a cache of a few 4-token blocks. Each line is one step: the batch (request
and how many tokens it got; ``*`` marks a row that samples a token), who was preempted, and the
queues afterwards. Preempted requests go back to the head of the waiting queue and are
recomputed; at the end every request has the same tokens the fake model produces for it alone,
and every block is free.

    python 04_scheduler/demo.py                       # two-phase, FCFS
    python 04_scheduler/demo.py --policy priority     # lower value = more important
    python 04_scheduler/demo.py --prefill-first       # nano-vllm's policy
    python 04_scheduler/demo.py --trace run.jsonl     # the real engine on the default model, traced
"""

from __future__ import annotations

import argparse

from block_manager import BlockManager, cdiv
from prefill_first import PrefillFirstScheduler
from scheduler import Request, Scheduler
from scheduler_testing import FakeModel, true_completion
from vllm_from_scratch.tools.viz import add_trace_argument

VOCAB = 50


def trace(path: str) -> None:
    """``--trace``: the same story in the real engine. Four chat requests on the default model
    share a KV cache of 16 blocks; their 40-token answers do not all fit, so the newest is
    preempted, waits, and is recomputed (finding its prompt in the prefix cache)."""
    from vllm_from_scratch.tools.viz import Arrival, demo_trace

    demo_trace(
        path,
        [
            Arrival("Write a short poem about the sea.", 40),
            Arrival("List three fruits.", 40),
            Arrival("What is a block table?", 40),
            Arrival("Count from one to ten.", 40),
        ],
        num_kvcache_blocks=16,
        max_num_batched_tokens=256,
        max_model_len=256,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--prefill-first", action="store_true", help="nano-vllm's prefill-or-decode steps")
    p.add_argument("--num-blocks", type=int, default=7, help="KV blocks of 4 tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=3)
    add_trace_argument(p)
    args = p.parse_args(argv)
    if args.trace:
        trace(args.trace)
        return

    bs = 4
    bm = BlockManager(args.num_blocks, bs)
    cls = PrefillFirstScheduler if args.prefill_first else Scheduler
    sched = cls(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=args.num_blocks,
        policy=args.policy,
        block_size=bs,
        block_manager=bm,
    )
    model = FakeModel(bm, VOCAB)
    specs = [("r0", 6, 6, 1), ("r1", 5, 7, 2), ("r2", 3, 5, 1), ("r3", 7, 4, 0)]  # id, prompt, max_tokens, priority
    reqs = [
        Request(
            rid,
            [(7 * i + j) % (VOCAB - 1) + 1 for j in range(n)],
            max_tokens=mt,
            priority=prio,
            arrival_time=float(i),
            ignore_eos=True,
            block_size=bs,
        )
        for i, (rid, n, mt, prio) in enumerate(specs)
    ]
    print(
        f"{cls.__name__}(policy={args.policy!r}), {args.num_blocks} blocks x {bs} tokens, "
        f"budget {args.max_num_batched_tokens} tokens, max_num_seqs {args.max_num_seqs}"
    )
    for r in reqs:
        print(
            f"  {r.request_id}: prompt {r.num_prompt_tokens} tokens, max_tokens {r.max_tokens}, "
            f"priority {r.priority}, needs up to {cdiv(r.max_num_kv_tokens, bs)} blocks"
        )
    arrivals = {0: reqs[:2], 1: reqs[2:3], 2: reqs[3:]}
    print(f"\n{'step':>4} | {'batch (id:tokens, * samples)':<34} | {'preempted':<9} | free | waiting / running")
    step = 0
    while step in arrivals or sched.has_requests() or step < max(arrivals):
        for r in arrivals.get(step, []):
            sched.add_request(r)
        out = sched.schedule()
        batch = " ".join(
            f"{r.request_id}:{out.num_scheduled_tokens[r.request_id]}" + ("*" if out.produces_token(r) else "")
            for r in out.scheduled_requests
        )
        preempted = ",".join(r.request_id for r in out.preempted_requests) or "-"
        sched.update_from_output(out, model.execute(out))
        sched.check_invariants()
        print(
            f"{step:>4} | {batch:<34} | {preempted:<9} | {bm.get_num_free_blocks():>4} | "
            f"{[r.request_id for r in sched.waiting]} / {[r.request_id for r in sched.running]}"
        )
        step += 1

    print("\nrequest  preemptions  tokens == the model's own greedy output")
    for r in reqs:
        ok = r.completion_token_ids == true_completion(r.prompt_token_ids, r.max_tokens, VOCAB, ignore_eos=True)
        print(f"{r.request_id:>7}  {r.num_preemptions:>11}  {r.completion_token_ids} {'OK' if ok else 'WRONG'}")
    stats = sched.get_stats()
    print(f"\n{step} steps, {stats['num_preemptions']} preemptions, all blocks free: {bm.all_blocks_free()}")


if __name__ == "__main__":
    main()
