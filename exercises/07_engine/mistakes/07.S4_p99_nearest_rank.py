import statistics


def summarize(results, duration):
    """Takes p99 as the value at rank int(0.99 * n), not by linear interpolation as vllm bench serve does."""
    ok = [r for r in results if r.ok]
    inputs, outputs = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    summary = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
    }
    for name, values in series.items():
        summary[f"mean_{name}_ms"] = 1000 * statistics.fmean(values) if values else float("nan")
        summary[f"median_{name}_ms"] = 1000 * statistics.median(values) if values else float("nan")
        summary[f"p99_{name}_ms"] = 1000 * sorted(values)[int(0.99 * len(values))] if values else float("nan")
    summary["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return summary
