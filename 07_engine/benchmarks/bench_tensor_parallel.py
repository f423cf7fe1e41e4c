"""What tensor parallelism costs and buys on this machine: two tables, not a test.

1. The communication alone, with a runner that does nothing else: the round trip of a call
   that does no work (the pickled broadcast plus rank 0's share) and of one all-reduce of a
   ``[tokens, hidden]`` activation, the collective every layer pays twice.
2. The engine: for each ``tensor_parallel_size`` the same seeded workload runs through
   ``LLM.generate`` on a random Llama-shaped checkpoint (built here, no download), with the
   pickled size of one real decode step's call.

    python 07_engine/benchmarks/bench_tensor_parallel.py --tp 1 2
    python 07_engine/benchmarks/bench_tensor_parallel.py --comm-only
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
import time

import torch

from machine import add_quiet_arg, check_quiet, load_average, machine_line


def build_checkpoint(path: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def machine() -> str:
    """The machine line, and the load: on a shared machine the load explains most of the spread."""
    return f"{machine_line()} (rank 0, before the split); load average {load_average()}"


class CommRunner:
    """A runner whose methods are pure communication (every rank builds one)."""

    def __init__(self, rank: int):
        self.rank = rank

    def noop(self) -> None:
        return None

    def all_reduce(self, tokens: int, hidden: int) -> None:
        import torch.distributed as dist

        dist.all_reduce(torch.ones(tokens, hidden))


def time_comm(world_size: int, args) -> dict:
    from vllm_from_scratch.distributed import TensorParallelExecutor

    executor = TensorParallelExecutor(CommRunner, world_size)
    row = dict(tp=world_size)
    for name, call_args in [
        ("noop", ()),
        ("decode", (args.num_prompts, args.hidden)),
        ("prefill", (args.num_prompts * args.prompt_len, args.hidden)),
    ]:
        method = "noop" if name == "noop" else "all_reduce"
        for _ in range(10):
            executor.call(method, *call_args)
        start = time.perf_counter()
        for _ in range(args.calls):
            executor.call(method, *call_args)
        row[name] = (time.perf_counter() - start) / args.calls * 1e6
    executor.shutdown()
    return row


def run_one(model_dir: str, tp: int, args) -> dict:
    from vllm_from_scratch import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, args.vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.num_prompts,), generator=g)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(
        model_dir,
        tensor_parallel_size=tp,
        device="cpu",
        dtype=args.dtype,
        num_kvcache_blocks=1024,
        max_num_seqs=args.num_prompts,
    )
    startup = time.perf_counter() - start
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    engine = llm.llm_engine
    start = time.perf_counter()
    for _ in range(args.calls):
        engine.executor.call("get_num_kvcache_blocks")
    call_us = (time.perf_counter() - start) / args.calls * 1e6
    # One decode step's scheduler output as the workers receive it (requests after their prefill).
    for p in prompts:
        engine.add_request(p, params)
    engine.step()
    decode = engine.scheduler.schedule()
    payload = len(pickle.dumps(("execute_model", (decode,), {})))
    engine.scheduler.update_from_output(decode, engine.executor.call("execute_model", decode).sampled_token_ids)
    while engine.has_unfinished_requests():
        engine.step()
    tokens = sum(len(o["token_ids"]) for o in outs)
    llm.shutdown()
    return dict(
        tp=tp,
        startup=startup,
        elapsed=elapsed,
        tok_s=tokens / elapsed,
        call_us=call_us,
        payload=payload,
        first=outs[0]["token_ids"][:8],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor_parallel_size values to run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64, help="prompts are this long or up to half shorter")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--calls", type=int, default=200, help="calls timed per communication measurement")
    parser.add_argument("--comm-only", action="store_true", help="only the communication table (no engine)")
    add_quiet_arg(parser)
    args = parser.parse_args()
    check_quiet(args.refuse_busy)
    from tqdm import tqdm

    comm = [time_comm(tp, args) for tp in tqdm([tp for tp in args.tp if tp > 1], desc="communication")]
    print(f"\nCommunication alone, gloo on the CPU, mean of {args.calls} calls; {machine()}\n")
    print(
        f"| TP | no-op call (µs) | call + all-reduce [{args.num_prompts}, {args.hidden}] (µs) "
        f"| call + all-reduce [{args.num_prompts * args.prompt_len}, {args.hidden}] (µs) |"
    )
    print("|---:|---:|---:|---:|")
    for r in comm:
        print(f"| {r['tp']} | {r['noop']:.0f} | {r['decode']:.0f} | {r['prefill']:.0f} |")
    if args.comm_only:
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(tmp, args.layers, args.hidden, args.heads, args.kv_heads, args.vocab)
        rows = [run_one(model_dir, tp, args) for tp in tqdm(args.tp, desc="tensor_parallel_size")]
    print(
        f"\nLlama {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, "
        f"vocab {args.vocab}, {args.dtype}; {args.num_prompts} prompts of <= {args.prompt_len} tokens, "
        f"{args.max_tokens} new tokens each, greedy; {machine()}\n"
    )
    print("| TP | start-up (s) | generate (s) | output tok/s | no-op call (µs) | decode-step call (bytes) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tp']} | {r['startup']:.1f} | {r['elapsed']:.2f} | {r['tok_s']:.0f} | {r['call_us']:.0f} "
            f"| {r['payload']:,} |"
        )
    same = all(r["first"] == rows[0]["first"] for r in rows)
    print(f"\nsame greedy tokens across TP sizes: {same}")


if __name__ == "__main__":  # required: TP workers are spawned, and spawn re-imports this module
    main()
