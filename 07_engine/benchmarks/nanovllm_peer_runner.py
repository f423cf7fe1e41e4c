"""Run ``bench.py --gpu``'s workload on nano-vllm itself, in a process of its own.

    python 07_engine/benchmarks/nanovllm_peer_runner.py SPEC.json RESULT.json

nano-vllm is never copied into the book: SPEC.json names the directory of its source
(``../shared/peers/nano-vllm``), which goes first on ``sys.path``. The rest of SPEC.json is the
workload ``bench.py`` times the engine on (model directory, prompts as token ids, output lengths,
temperature) and nano-vllm's settings (``enforce_eager``, ``max_model_len``). Like nano-vllm's own
``bench.py``, it runs a short request first, then times one ``generate`` over the whole workload
and counts the tokens asked for. RESULT.json gets the throughput, the seconds and the settings.
A process of its own, because nano-vllm starts its process group on a fixed port and keeps
CUDA state until its process exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def run(spec: dict) -> dict:
    sys.path.insert(0, spec["nano_vllm_dir"])
    from nanovllm import LLM, SamplingParams

    settings = {"enforce_eager": spec["enforce_eager"], "max_model_len": spec["max_model_len"]}
    start = time.perf_counter()
    llm = LLM(spec["model"], **settings)
    startup_s = time.perf_counter() - start
    prompts, outputs = spec["prompts"], spec["outputs"]
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=spec["temperature"], ignore_eos=True, max_tokens=n) for n in outputs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    got = [len(o["token_ids"]) for o in outs]
    if got != outputs:
        raise RuntimeError(f"nano-vllm returned other output lengths than asked for: {got[:8]} ...")
    return {
        "output_tokens_per_s": sum(outputs) / elapsed,
        "elapsed_s": elapsed,
        "startup_s": startup_s,
        "settings": settings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="the workload and settings, written by bench.py")
    parser.add_argument("result", help="where to write the throughput")
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    with open(args.result, "w") as f:
        json.dump(run(spec), f)


if __name__ == "__main__":
    main()
