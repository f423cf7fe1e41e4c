"""Compile time and per-step mask cost of three grammar libraries on the default model's tokenizer:
xgrammar (the engine's), llguidance and outlines-core, on one JSON schema and one valid output.

For each: building its view of the vocabulary (once per model), compiling the schema (once per
schema), and one step of decoding (the allowed-token mask for the current state, then advancing
by the token), averaged over the output's tokens. It runs in vLLM's virtualenv, which has all
three (``07_engine/benchmarks/make_vllm_venv.sh``):

    /work/.venv-vllm/bin/python 07_engine/benchmarks/grammar_backends.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]})


def per_step(steps, ids) -> float:
    """Microseconds per token of ``steps(token)`` (mask, then advance) over ``ids``."""
    start = time.perf_counter()
    for token in ids:
        steps(token)
    return (time.perf_counter() - start) * 1e6 / len(ids)


def timed(make):
    start = time.perf_counter()
    value = make()
    return value, (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.model is None:  # the book's package, by path: vLLM's virtualenv does not install it
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from vllm_from_scratch.default_model import default_model_dir

        args.model = default_model_dir()
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok.encode(TEXT, add_special_tokens=False)
    vocab = len(tok)
    print(f"vocabulary {vocab} tokens; the output is {len(ids)} tokens")

    import xgrammar as xgr

    info, info_ms = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    grammar, compile_ms = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher, bitmask = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab)

    def xgrammar_step(token: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)
        assert matcher.accept_token(token)

    report("xgrammar", info_ms, compile_ms, per_step(xgrammar_step, ids))

    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tok, info_ms = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    ll_matcher, compile_ms = timed(
        lambda: llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    )
    ll_mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def llguidance_step(token: int) -> None:
        llguidance.torch.fill_next_token_bitmask(ll_matcher, ll_mask, 0)
        assert ll_matcher.consume_token(token), ll_matcher.get_error()

    report("llguidance", info_ms, compile_ms, per_step(llguidance_step, ids))

    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask

    def outlines_vocabulary() -> Vocabulary:
        by_text: dict[str, list[int]] = {}
        for token, token_id in tok.get_vocab().items():
            if token_id != tok.eos_token_id:
                by_text.setdefault(tok.convert_tokens_to_string([token]), []).append(token_id)
        return Vocabulary(tok.eos_token_id, by_text)

    voc, info_ms = timed(outlines_vocabulary)
    index, compile_ms = timed(lambda: Index(build_regex_from_schema(json.dumps(SCHEMA)), voc))
    guide, o_mask = Guide(index), allocate_token_bitmask(vocab)

    def outlines_step(token: int) -> None:
        fill_next_token_bitmask(guide, o_mask)
        guide.advance(token)

    report("outlines-core", info_ms, compile_ms, per_step(outlines_step, ids))


def report(name: str, info_ms: float, compile_ms: float, step_us: float) -> None:
    timings = f"vocabulary {info_ms:7.0f} ms   compile {compile_ms:7.1f} ms   mask + advance {step_us:6.0f} us/token"
    print(f"{name:14s} {timings}")


if __name__ == "__main__":
    main()
