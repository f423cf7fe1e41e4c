"""A short offline chat with the embedded default model (SmolLM2-135M-Instruct) on the engine.

Three questions go through the model's chat template as one batch, then a follow-up continues
the first conversation. Answers are greedy, so they are the same on every run ("The capital of
France is Paris." among them). The follow-up's prompt repeats the whole first exchange, whose
KV blocks are still in the prefix cache: the counters printed at the end show those hits.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

from vllm_from_scratch import LLM, SamplingParams, default_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 + 30?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--question", action="append", help="ask this instead (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 where the CPU has it in hardware, else float32 (default: %(default)s)",
    )
    args = parser.parse_args()

    llm = LLM(default_model_dir(), dtype=args.dtype, device="cpu", max_model_len=1024, num_kvcache_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    template = partial(llm.tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True)
    chats = [[{"role": "user", "content": q}] for q in args.question or QUESTIONS]
    start = time.perf_counter()
    outs = llm.generate([template(c) for c in chats], params, use_tqdm=False)
    for chat, out in zip(chats, outs):
        chat.append({"role": "assistant", "content": out["text"].strip()})
    follow_up = chats[0] + [{"role": "user", "content": "And what is the capital of Italy?"}]
    outs.append(llm.generate([template(follow_up)], params, use_tqdm=False)[0])
    follow_up.append({"role": "assistant", "content": outs[-1]["text"].strip()})
    elapsed = time.perf_counter() - start
    for chat in chats[1:] + [follow_up]:
        for turn in chat:
            print(f"{turn['role']:>9}: {turn['content']}")
        print()
    stats = llm.llm_engine.get_stats()
    n = sum(len(o["token_ids"]) for o in outs)
    print(
        f"{n} tokens generated in {elapsed:.1f} s; prompt tokens {stats['prompt_tokens_total']}, "
        f"prefix-cache hits {stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} queried tokens; "
        f"KV blocks in use after the batch: {llm.llm_engine.block_manager.usage:.0%}"
    )


if __name__ == "__main__":
    main()
