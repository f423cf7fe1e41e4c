"""lm-evaluation-harness through the server scores what transformers scores: ``lm_eval_check.py``
on the first questions of both tasks of 07_engine/eval.

The harness is never part of the book's set-up: the real run needs ``.venv-lmeval``
(``07_engine/benchmarks/make_lmeval_venv.sh``) and skips without it. What the check does with
the harness's logged samples is tested everywhere, on samples written here.
"""

import pytest

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
    same = lm_eval_check.check_multiple_choice("facts_mc", {"acc,none": 1.0}, [mc_sample([-1.0004, -3.0])], ref, 1e-3)
    assert same.ok and same.reference_score == 1.0 and same.max_loglik_diff == pytest.approx(4e-4)
    off = lm_eval_check.check_multiple_choice("facts_mc", {"acc,none": 1.0}, [mc_sample([-1.01, -3.0])], ref, 1e-3)
    assert not off.ok and "facts_mc #0" in off.disagreements[0]
    flipped = lm_eval_check.check_multiple_choice("facts_mc", {"acc,none": 0.0}, [mc_sample([-3.0, -1.0])], ref, 9.0)
    assert not flipped.ok, "a different chosen answer is a disagreement whatever the tolerance"


def test_generation_compares_raw_text_and_scores_as_the_task_does():
    ref = ScriptedReference({}, " paris.")
    same = lm_eval_check.check_generation("facts_gen", {"exact_match,strip": 1.0}, [gen_sample(" paris.")], ref)
    assert same.ok and same.reference_score == 1.0, "case, punctuation and spaces are ignored by the metric"
    off = lm_eval_check.check_generation("facts_gen", {"exact_match,strip": 1.0}, [gen_sample(" Paris.")], ref)
    assert not off.ok and "server ' Paris.', transformers ' paris.'" in off.disagreements[0]
    wrong_score = lm_eval_check.check_generation("facts_gen", {"exact_match,strip": 0.0}, [gen_sample(" paris.")], ref)
    assert not wrong_score.ok, "equal answers but a different reported score"


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
