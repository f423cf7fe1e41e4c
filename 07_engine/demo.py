"""A short offline chat with the embedded default model (SmolLM2-135M-Instruct) on the engine.

Three questions go through the model's chat template as one batch, then a follow-up continues
the first conversation. Answers are greedy, so they are the same on every run ("The capital of
France is Paris." among them). The follow-up's prompt repeats the whole first exchange, whose
KV blocks are still in the prefix cache: the counters printed at the end show those hits.

``--structured`` asks instead for a JSON object matching a schema (a book: title, year, tags),
twice: free, and then with the schema enforced on the logits (``structured_outputs``); each
answer is parsed and checked against the schema (07_engine/topics/structured_outputs.md).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

from vllm_from_scratch import LLM, SamplingParams, StructuredOutputsParams, default_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 + 30?",
]


BOOK_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}


def schema_errors(text: str) -> str:
    """Why ``text`` is not a book under :data:`BOOK_SCHEMA` ("" when it is): the rules the
    schema states on keys and types, checked by hand so the demo needs no validator."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg})"
    if not isinstance(value, dict) or set(value) != set(BOOK_SCHEMA["required"]):
        return "not an object with exactly title, year and tags"
    ok = isinstance(value["title"], str) and isinstance(value["year"], int) and isinstance(value["tags"], list)
    return "" if ok else "a field has the wrong type"


def structured_demo(llm: LLM, max_tokens: int) -> None:
    question = [{"role": "user", "content": "Describe a famous book as a JSON object with its title, year and tags."}]
    constraint = StructuredOutputsParams(json=BOOK_SCHEMA)
    for label, so in (("free", None), ("with the schema", constraint)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
        out = llm.chat([question], params, use_tqdm=False)[0].outputs[0]
        verdict = schema_errors(out.text) or "valid under the schema"
        print(f"--- {label} ({len(out.token_ids)} tokens, finish: {out.finish_reason}): {verdict}\n{out.text}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--question", action="append", help="ask this instead (repeatable)")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="per answer (default: %(default)s; 96 with --structured)"
    )
    parser.add_argument("--structured", action="store_true", help="ask for a JSON book, free and under a schema")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 where the CPU has it in hardware, else float32 (default: %(default)s)",
    )
    args = parser.parse_args()

    llm = LLM(default_model_dir(), dtype=args.dtype, device="cpu", max_model_len=1024, num_kvcache_blocks=256)
    if args.structured:
        structured_demo(llm, max(args.max_tokens, 96))
        return
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
