"""Exercise 07.S4 of 07_engine: your versions of load_generator.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from load_generator import RequestResult


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Summarize a load test the way vllm bench serve does

    Hint: Over successful requests: request and token throughputs, and mean / median / p99 of
    TTFT, TPOT = (e2e - TTFT) / (output tokens - 1) and ITL (every gap of every request).

    Checked by: pytest 07_engine/ --impl=student --exercise 07.S4
    """
    raise NotImplementedError("Exercise 07.S4: implement summarize — see 07_engine/topics/serving.md#exercises")
