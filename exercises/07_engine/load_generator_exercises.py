"""Exercise 07.S4 of 07_engine: your versions of load_generator.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from load_generator import RequestResult


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Summarize a load test the way vllm bench serve does

    Hint: The keys format_report reads: successful_requests, failed_requests, duration_s,
    total_input_tokens, total_output_tokens, request_throughput, output_throughput and
    total_token_throughput (over successful requests, per second of duration); then mean_,
    median_ and p99_ of ttft, tpot and itl, each _ms: TTFT, TPOT = (e2e - TTFT) / (output tokens
    - 1) for requests with more than one output token, and ITL (every gap of every request), p99
    by percentile() (linear interpolation), NaN when there are none; errors: the first five
    distinct error messages of failed requests, sorted.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.S4
    """
    raise NotImplementedError("Exercise 07.S4: implement summarize — see 07_engine/topics/serving.md#exercises")
