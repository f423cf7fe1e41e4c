"""lm-evaluation-harness through our server scores what transformers scores on the same model.

    .venv/bin/python 07_engine/benchmarks/lm_eval_check.py             # both tasks, 20 questions each
    .venv/bin/python 07_engine/benchmarks/lm_eval_check.py --limit 5   # what test_lm_eval.py runs
    .venv/bin/python 07_engine/benchmarks/lm_eval_check.py --vllm      # and vLLM's own server beside

Starts the server (``python -m vllm_from_scratch.serve``) on the default model and runs
lm-evaluation-harness (``lm_eval --model local-completions``, from the virtualenv that
``make_lmeval_venv.sh`` builds) against it on 07_engine/eval's two tasks, with ``--log_samples``:

* ``facts_mc`` (multiple choice, metric acc): every choice's loglikelihood after the question,
  which the harness reads from ``/v1/completions`` with ``echo`` and ``logprobs``;
* ``facts_gen`` (greedy generation cut at a newline, metric exact_match).

Then it scores the same requests with transformers in this process, from the contexts the
harness logged: the loglikelihood of each choice over the token ids the harness sends (its
``_encode_pair``), and ``generate`` greedily. It prints both scores and how many questions agree
(the same chosen answer and each loglikelihood within ``--atol``; the same generated text), and
exits 1 on any difference. Nothing reaches a model hub: the tasks' data are files beside them.

With ``--vllm``, the harness then runs the same tasks against vLLM's CPU build's server (``vllm
serve`` from ``.venv-vllm``, built by ``make_vllm_venv.sh``; started as bench_serving.py starts
it) on the same model directory, dtype and context length, and the table gains vLLM's scores and
its agreement with transformers by the same rule. vLLM's column is a finding, never a failure:
the exit status is our server's.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import json
import os
import string
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from bench import VLLM_VENV, vllm_python, vllm_version
from bench_serving import vllm_server
from machine import machine_line
from server_testing import ServerProcess
from vllm_from_scratch import default_model_dir
from vllm_from_scratch.default_model import MODEL_NAME
from vllm_from_scratch.loader import DTYPES

REPO = Path(__file__).resolve().parents[2]
EVAL_DIR = REPO / "07_engine" / "eval"
LMEVAL_VENV = REPO / ".venv-lmeval"
TASKS = ("facts_mc", "facts_gen")
# The engine's context here: the harness left-truncates to the same length.
MAX_MODEL_LEN = 512
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kvcache-blocks", "256", "--no-warm-up"]
# Per choice, float32: the engine's paged attention and transformers sum in different orders,
# over 30 layers and a few continuation tokens.
DEFAULT_ATOL = 1e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# vLLM's server as it ships: its own thread layout (one core computes, one serves), its default
# --max-logprobs (20) and prefix caching; the same name and context length as ours.
VLLM_ARGS = ("--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN))
VLLM_BINDING = "defaults"


@dataclass
class TaskCheck:
    """One task's score through one server (``server``: its name) and from transformers, and the
    questions that differ."""

    server: str
    task: str
    metric: str
    server_score: float
    reference_score: float
    questions: int
    disagreements: list[str] = field(default_factory=list)
    max_loglik_diff: float | None = None  # multiple choice only

    @property
    def ok(self) -> bool:
        return not self.disagreements and self.server_score == self.reference_score


class TransformersReference:
    """The checkpoint in transformers, scored the way lm-eval's local-completions scores a server."""

    def __init__(self, model_dir: str, dtype: torch.dtype):
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def encode(self, text: str) -> list[int]:
        # The harness adds no BOS for local-completions (add_bos_token=False).
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's ``TemplateLM._encode_pair`` for a causal model: the context's trailing
        whitespace moves to the continuation, and the whole text is tokenized at once, so the
        continuation's ids are those that follow the context's in the joint tokenization."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        context_ids = self.encode(context)
        return context_ids, whole[len(context_ids) :]

    @torch.no_grad()
    def loglikelihood(self, context: str, continuation: str) -> float:
        """The sum of the continuation tokens' log-softmax, each predicted from all before it."""
        context_ids, continuation_ids = self.encode_pair(context, continuation)
        ids = (context_ids + continuation_ids)[-(MAX_MODEL_LEN - 1) :]
        logits = self.model(torch.tensor([ids])).logits[0, -len(continuation_ids) - 1 : -1]
        logprobs = logits.float().log_softmax(-1)
        return float(logprobs[torch.arange(len(continuation_ids)), torch.tensor(continuation_ids)].sum())

    @torch.no_grad()
    def generate(self, context: str, max_gen_toks: int, stop: list[str]) -> str:
        """Greedy ``generate`` until EOS or ``max_gen_toks`` tokens, cut before the first stop
        string, as the server answers the harness's request."""
        ids = torch.tensor([self.encode(context)[-(MAX_MODEL_LEN - 1 - max_gen_toks) :]])
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_gen_toks,
            do_sample=False,
            pad_token_id=self.tokenizer.eos_token_id,
        )
        text = self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        for s in stop:
            text = text.split(s)[0]
        return text


def lm_eval_command(url: str, model_dir: str, tasks: list[str], out: Path, args: argparse.Namespace) -> list[str]:
    """``lm_eval`` against the server: token-id prompts (``tokenized_requests``), the model's own
    tokenizer from its directory, and the tasks of 07_engine/eval (``--include_path``)."""
    model_args = {
        "base_url": f"{url}/v1/completions",
        "model": MODEL_NAME,
        "tokenizer": model_dir,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": args.num_concurrent,
        "max_retries": 1,  # a refused request is a failure to report, not to retry
        "max_length": MAX_MODEL_LEN,
    }
    command = [
        str(args.lmeval_venv / "bin" / "lm_eval"),
        "--model",
        "local-completions",
        "--model_args",
        ",".join(f"{k}={v}" for k, v in model_args.items()),
        "--tasks",
        ",".join(tasks),
        "--include_path",
        str(EVAL_DIR),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    return command + (["--limit", str(args.limit)] if args.limit else [])


def run_lm_eval(command: list[str], out: Path) -> None:
    # data_files in the task YAMLs are relative: datasets resolves them against the working directory.
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env |= OFFLINE | {"HF_DATASETS_CACHE": str(out / "datasets"), "LMEVAL_LOG_LEVEL": "WARNING"}
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=EVAL_DIR, env=env)


def read_results(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """lm-eval's report (``results``: per task, "metric,filter" -> score) and its logged samples per task."""
    (results_file,) = glob.glob(str(out / "*" / "results_*.json"))
    report = json.loads(Path(results_file).read_text())
    samples = {}
    for task in report["results"]:
        (samples_file,) = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
        lines = Path(samples_file).read_text().splitlines()
        samples[task] = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
    return report, samples


def arguments(sample: dict) -> list[tuple]:
    """A sample's requests in order: ``(context, continuation)`` per choice, or ``(context, gen_kwargs)``."""
    args = sample["arguments"]
    return [tuple(args[f"gen_args_{i}"].values()) for i in range(len(args))]


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equals, as numpy's


def reference_loglikelihoods(task: str, samples: list[dict], ref: TransformersReference) -> list[list[float]]:
    """Per multiple-choice sample, transformers' loglikelihood of each choice."""
    return [
        [ref.loglikelihood(context, choice) for context, choice in arguments(s)]
        for s in tqdm(samples, desc=f"transformers {task}")
    ]


def reference_generations(task: str, samples: list[dict], ref: TransformersReference) -> list[str]:
    """Per generation sample, transformers' greedy text, stopped as the harness asks."""
    texts = []
    for s in tqdm(samples, desc=f"transformers {task}"):
        ((context, gen_kwargs),) = arguments(s)
        # The harness adds the tokenizer's EOS text to the stop strings.
        stop = [*gen_kwargs["until"], ref.tokenizer.eos_token]
        texts.append(ref.generate(context, gen_kwargs["max_gen_toks"], stop))
    return texts


def check_multiple_choice(
    task: str, results: dict, samples: list[dict], reference: list[list[float]], atol: float, server: str = "server"
) -> TaskCheck:
    """``server``'s logged loglikelihoods beside transformers' (``reference``, per sample)."""
    check = TaskCheck(server, task, "acc", results["acc,none"], 0.0, len(samples), max_loglik_diff=0.0)
    correct = 0
    for s, expected in zip(samples, reference, strict=True):
        got = [float(r[0][0]) for r in s["resps"]]
        diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
        check.max_loglik_diff = max(check.max_loglik_diff or 0.0, diff)
        correct += argmax(expected) == int(s["target"])  # the gold choice's index, logged as a string
        if argmax(got) != argmax(expected) or diff > atol:
            choice = (
                "the same choice"
                if argmax(got) == argmax(expected)
                else f"chooses {argmax(got)}, transformers {argmax(expected)}"
            )
            check.disagreements.append(
                f"{task} #{s['doc_id']}: {server} loglikelihoods {[round(x, 4) for x in got]}, "
                f"transformers {[round(x, 4) for x in expected]} ({choice}; max |Δ| {diff:.1e})"
            )
    check.reference_score = correct / len(samples)
    return check


def normalize(answer: str) -> str:
    """facts_gen.yaml's filter and metric: surrounding whitespace, case and punctuation ignored."""
    return answer.strip().lower().translate(str.maketrans("", "", string.punctuation))


def check_generation(
    task: str, results: dict, samples: list[dict], reference: list[str], server: str = "server"
) -> TaskCheck:
    """``server``'s logged generations beside transformers' (``reference``, per sample)."""
    check = TaskCheck(server, task, "exact_match", results["exact_match,strip"], 0.0, len(samples))
    correct = 0
    for s, expected in zip(samples, reference, strict=True):
        got = s["resps"][0][0]
        correct += normalize(expected) == normalize(s["target"])
        if got != expected:
            check.disagreements.append(f"{task} #{s['doc_id']}: {server} {got!r}, transformers {expected!r}")
    check.reference_score = correct / len(samples)
    return check


def check_tasks(
    report: dict, samples: dict[str, list[dict]], reference: dict[str, list], atol: float, server: str
) -> list[TaskCheck]:
    """Every task of one harness run (``report``, ``samples``) beside transformers' answers."""
    results = report["results"]
    return [
        check_multiple_choice(task, results[task], samples[task], expected, atol, server)
        if task == "facts_mc"
        else check_generation(task, results[task], samples[task], expected, server)
        for task, expected in reference.items()
    ]


def print_table(checks: list[TaskCheck], peer: list[TaskCheck], dtype: str, versions: str) -> None:
    """Per task: our server's score, transformers', and how many questions agree; with ``peer``
    (vLLM's checks of the same tasks), vLLM's score and agreement in three more columns."""
    print(machine_line())
    print(f"{MODEL_NAME}, {dtype}: {versions}")
    row = "{:<10} {:<12} {:>7} {:>12} {:>9} {:>15}"
    head = ["task", "metric", "server", "transformers", "agreeing", "max |Δ loglik|"]
    if peer:
        row += " {:>7} {:>9} {:>15}"
        head += ["vLLM", "agreeing", "max |Δ loglik|"]
    print(row.format(*head))
    for c, v in zip(checks, peer or [None] * len(checks), strict=True):
        cells = [c.task, c.metric, f"{c.server_score:.3f}", f"{c.reference_score:.3f}", *agreement(c)]
        if v is not None:
            cells += [f"{v.server_score:.3f}", *agreement(v)]
        print(row.format(*cells))
    for c in [*checks, *peer]:
        for line in c.disagreements:
            print("differs:", line)


def agreement(check: TaskCheck) -> list[str]:
    """The table's agreeing and max |Δ loglik| cells of one check."""
    diff = "-" if check.max_loglik_diff is None else f"{check.max_loglik_diff:.1e}"
    return [f"{check.questions - len(check.disagreements)}/{check.questions}", diff]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="tasks to run (default: both)")
    p.add_argument("--limit", type=int, default=None, help="the first N questions of each task (default: all 20)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="the server's and transformers' dtype (default: %(default)s)",
    )
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="largest loglikelihood difference per choice")
    p.add_argument("--num-concurrent", type=int, default=1, help="requests the harness keeps in flight")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="also run the tasks against vLLM's CPU build's server (vllm serve from --vllm-venv)",
    )
    p.add_argument(
        "--vllm-venv",
        type=Path,
        default=VLLM_VENV,
        help="vLLM's virtualenv (default: .venv-vllm, built by 07_engine/benchmarks/make_vllm_venv.sh)",
    )
    p.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE for vLLM")
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=900.0,
        help="vLLM's start-up limit; it compiles its model first (minutes on 2 cores)",
    )
    p.add_argument(
        "--lmeval-venv",
        type=Path,
        default=LMEVAL_VENV,
        help="lm-eval's virtualenv (default: .venv-lmeval, built by 07_engine/benchmarks/make_lmeval_venv.sh)",
    )
    return p.parse_args(argv)


def evaluate(server: ServerProcess, model_dir: str, out: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """The harness's run of ``args.tasks`` against ``server``: its report and its logged samples."""
    with server:
        run_lm_eval(lm_eval_command(server.url, model_dir, args.tasks, out, args), out)
    return read_results(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.lmeval_venv / "bin" / "lm_eval").exists():
        raise SystemExit(f"no lm_eval in {args.lmeval_venv}: build it with 07_engine/benchmarks/make_lmeval_venv.sh")
    python = vllm_python(args.vllm_venv) if args.vllm else None
    os.environ.update(OFFLINE)
    model_dir = default_model_dir()
    server_args = ["vllm_from_scratch.serve", model_dir, "--served-model-name", MODEL_NAME, "--dtype", args.dtype]
    peer_run: tuple[dict, dict] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        report, samples = evaluate(ServerProcess([*server_args, *SERVER_ARGS]), model_dir, Path(tmp) / "server", args)
        if python is not None:
            vllm = vllm_server(
                python, model_dir, args.dtype, VLLM_BINDING, args.vllm_kv_cache_gib, args.startup_timeout_s, VLLM_ARGS
            )
            peer_run = evaluate(vllm, model_dir, Path(tmp) / "vllm", args)
    ref = TransformersReference(model_dir, DTYPES[args.dtype])
    reference: dict[str, list] = {}
    if "facts_mc" in args.tasks:
        reference["facts_mc"] = reference_loglikelihoods("facts_mc", samples["facts_mc"], ref)
    if "facts_gen" in args.tasks:
        reference["facts_gen"] = reference_generations("facts_gen", samples["facts_gen"], ref)
    checks = check_tasks(report, samples, reference, args.atol, "server")
    versions = f"lm-eval {report['lm_eval_version']} through our server vs transformers {md.version('transformers')}"
    peer = []
    if peer_run is not None and python is not None:
        peer = check_tasks(*peer_run, reference, args.atol, "vLLM")
        versions += f" and vllm serve (vLLM {vllm_version(python)} CPU, {VLLM_BINDING})"
    print_table(checks, peer, args.dtype, versions)
    ok = all(c.ok for c in checks)
    print("passed: the same scores, question by question" if ok else "FAILED: the server and transformers differ")
    if peer:
        same = all(c.ok for c in peer)
        print(f"vLLM: {'the same scores, question by question' if same else 'differs from transformers (above)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
