"""lm-evaluation-harness through the server scores what transformers scores: ``lm_eval_check.py``
on the first questions of both tasks of 07_engine/eval.

The harness is never part of the book's set-up: the real run needs ``.venv-lmeval``
(``07_engine/benchmarks/make_lmeval_venv.sh``) and skips without it, and the run beside vLLM's
server (``--vllm``) needs ``.venv-vllm`` too. What the check does with the harness's logged
samples, and how ``--vllm`` starts vLLM and fills its columns, are tested everywhere, on samples
written here.
"""

import sys

import pytest

import bench
import bench_serving
import lm_eval_check


class ScriptedReference:
    """Stands in for transformers: fixed loglikelihoods per continuation, a fixed generation."""

    def __init__(self, logliks: dict[str, float], text: str):
        self.logliks, self.text = logliks, text
        self.tokenizer = type("Tok", (), {"eos_token": "<|im_end|>"})()

    def loglikelihood(self, context: str, continuation: str) -> float:
        return self.logliks[continuation]

    def generate(self, context: str, max_gen_toks: int, stop: list[str]) -> str:
        assert stop == ["\n", "<|im_end|>"], "the harness's stop strings and the EOS text"
        return self.text


def mc_sample(server_logliks: list[float]) -> dict:
    choices = [" Paris", " London"]
    return {
        "doc_id": 0,
        "target": "0",
        "arguments": {
            f"gen_args_{i}": {"arg_0": "Question: capital?\nAnswer:", "arg_1": c} for i, c in enumerate(choices)
        },
        "resps": [[[x, False]] for x in server_logliks],
    }


def gen_sample(server_text: str) -> dict:
    kwargs = {"until": ["\n"], "max_gen_toks": 8}
    return {
        "doc_id": 0,
        "target": "Paris",
        "arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": kwargs}},
        "resps": [[server_text]],
    }


def test_multiple_choice_agrees_within_atol_and_differs_beyond():
    ref = ScriptedReference({" Paris": -1.0, " London": -3.0}, "")
    reference = lm_eval_check.reference_loglikelihoods("facts_mc", [mc_sample([0.0, 0.0])], ref)
    assert reference == [[-1.0, -3.0]], "each choice's loglikelihood, in the harness's order"
    check = lm_eval_check.check_multiple_choice
    same = check("facts_mc", {"acc,none": 1.0}, [mc_sample([-1.0004, -3.0])], reference, 1e-3)
    assert same.ok and same.reference_score == 1.0 and same.max_loglik_diff == pytest.approx(4e-4)
    off = check("facts_mc", {"acc,none": 1.0}, [mc_sample([-1.01, -3.0])], reference, 1e-3)
    assert not off.ok and "facts_mc #0" in off.disagreements[0] and "the same choice" in off.disagreements[0]
    flipped = check("facts_mc", {"acc,none": 0.0}, [mc_sample([-3.0, -1.0])], reference, 9.0, server="vLLM")
    assert not flipped.ok, "a different chosen answer is a disagreement whatever the tolerance"
    assert "vLLM loglikelihoods [-3.0, -1.0]" in flipped.disagreements[0]
    assert "chooses 1, transformers 0" in flipped.disagreements[0]


def test_generation_compares_raw_text_and_scores_as_the_task_does():
    reference = lm_eval_check.reference_generations("facts_gen", [gen_sample("")], ScriptedReference({}, " paris."))
    assert reference == [" paris."]
    check = lm_eval_check.check_generation
    same = check("facts_gen", {"exact_match,strip": 1.0}, [gen_sample(" paris.")], reference)
    assert same.ok and same.reference_score == 1.0, "case, punctuation and spaces are ignored by the metric"
    off = check("facts_gen", {"exact_match,strip": 1.0}, [gen_sample(" Paris.")], reference)
    assert not off.ok and "server ' Paris.', transformers ' paris.'" in off.disagreements[0]
    wrong_score = check("facts_gen", {"exact_match,strip": 0.0}, [gen_sample(" paris.")], reference)
    assert not wrong_score.ok, "equal answers but a different reported score"


def test_vllm_serve_runs_from_its_venv_with_the_binding_and_only_the_given_vllm_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")  # the caller's own setting must not leak in
    python = tmp_path / "bin" / "python"
    server = bench_serving.vllm_server(python, "/m", "float32", "all-cores-bound", 2, 60.0, ("--max-model-len", "9"))
    assert server.args == [
        str(python),
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        "/m",
        "--dtype",
        "float32",
        "--max-model-len",
        "9",
        "--port",
        str(server.port),
    ]
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == bench.usable_cores()
    assert server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and server.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    defaults = bench_serving.vllm_server(python, "/m", "float32", "defaults", 2, 60.0)
    assert not {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"} & defaults.env.keys()


def test_vllm_gets_its_own_columns_and_never_fails_the_check(tmp_path, monkeypatch, capsys):
    """``--vllm``: the harness runs against our server, then against ``vllm serve`` (same model,
    dtype, name and context length); vLLM's flipped answer shows in its columns, not in the exit status."""
    for venv, program in (("lmeval", "lm_eval"), ("vllm", "python")):
        (tmp_path / venv / "bin").mkdir(parents=True)
        (tmp_path / venv / "bin" / program).write_text("")
    started = []

    def harness_run(server, model_dir, out, args):  # what the harness would log against each server
        started.append(server.args)
        vllm = isinstance(server, bench_serving.VenvServer)
        report = {"lm_eval_version": "0.4.13", "results": {"facts_mc": {"acc,none": 0.0 if vllm else 1.0}}}
        return report, {"facts_mc": [mc_sample([-3.0, -1.0] if vllm else [-1.0, -3.0])]}

    monkeypatch.setattr(lm_eval_check, "evaluate", harness_run)
    monkeypatch.setattr(lm_eval_check, "default_model_dir", lambda: "/models/smol")
    monkeypatch.setattr(lm_eval_check, "vllm_version", lambda python: "0.32.0")
    references = []

    def transformers(model_dir, dtype):
        references.append((model_dir, dtype))
        return ScriptedReference({" Paris": -1.0, " London": -3.0}, "")

    monkeypatch.setattr(lm_eval_check, "TransformersReference", transformers)
    argv = ["--vllm", "--vllm-venv", str(tmp_path / "vllm"), "--lmeval-venv", str(tmp_path / "lmeval")]
    status = lm_eval_check.main([*argv, "--tasks", "facts_mc", "--dtype", "bfloat16"])
    report = capsys.readouterr().out
    assert status == 0, report
    ours, vllm = started
    assert ours[:3] == [sys.executable, "-m", "vllm_from_scratch.serve"]
    assert vllm[0] == str(tmp_path / "vllm" / "bin" / "python") and vllm[vllm.index("--model") + 1] == "/models/smol"
    for flag, value in (("--dtype", "bfloat16"), ("--served-model-name", "SmolLM2-135M-Instruct")):
        assert vllm[vllm.index(flag) + 1] == value == ours[ours.index(flag) + 1]
    assert vllm[vllm.index("--max-model-len") + 1] == str(lm_eval_check.MAX_MODEL_LEN)
    assert references == [("/models/smol", lm_eval_check.DTYPES["bfloat16"])], "transformers scores once, for both"
    (row,) = [line.split() for line in report.splitlines() if line.startswith("facts_mc")]
    assert row == ["facts_mc", "acc", "1.000", "1.000", "1/1", "0.0e+00", "0.000", "0/1", "2.0e+00"]
    assert "vLLM 0.32.0" in report and "differs: facts_mc #0: vLLM loglikelihoods" in report


@pytest.mark.slow
@pytest.mark.skipif(
    not (lm_eval_check.LMEVAL_VENV / "bin" / "lm_eval").exists(),
    reason="lm-evaluation-harness is optional: build .venv-lmeval with 07_engine/benchmarks/make_lmeval_venv.sh",
)
def test_harness_scores_through_the_server_equal_transformers(capsys):
    # Five questions each: 20 loglikelihood requests and 5 greedy generations.
    status = lm_eval_check.main(["--limit", "5"])
    report = capsys.readouterr().out
    assert status == 0, report
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line.startswith("facts_")}
    assert rows.keys() == {"facts_mc", "facts_gen"}, report
    for task, metric, server, reference, agreeing, *_ in rows.values():
        assert server == reference and agreeing == "5/5", f"{task} {metric}: {report}"


@pytest.mark.slow
@pytest.mark.skipif(
    not (lm_eval_check.LMEVAL_VENV / "bin" / "lm_eval").exists() or not (bench.VLLM_VENV / "bin" / "python").exists(),
    reason="needs both optional virtualenvs: .venv-lmeval (make_lmeval_venv.sh) and .venv-vllm (make_vllm_venv.sh)",
)
def test_vllm_serve_scores_what_transformers_scores_in_float32(capsys):
    # Two questions each through both servers; vLLM's start-up (about 90 s on 2 cores) dominates.
    status = lm_eval_check.main(["--limit", "2", "--vllm"])
    report = capsys.readouterr().out
    assert status == 0, report
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line.startswith("facts_")}
    assert rows.keys() == {"facts_mc", "facts_gen"}, report
    for task, metric, server, reference, agreeing, _, vllm, vllm_agreeing, _ in rows.values():
        assert server == reference == vllm and agreeing == vllm_agreeing == "2/2", f"{task} {metric}: {report}"
