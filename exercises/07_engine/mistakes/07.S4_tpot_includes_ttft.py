import statistics

from load_generator import percentile


def summarize(results, duration):
    """Divides the whole latency by the output tokens: TPOT must leave the first token's wait (TTFT) out."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    tpots = [r.e2e / r.output_tokens for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        summary[f"mean_{name}_ms"] = 1000 * statistics.fmean(values) if values else float("nan")
        summary[f"median_{name}_ms"] = 1000 * statistics.median(values) if values else float("nan")
        summary[f"p99_{name}_ms"] = 1000 * percentile(values, 99) if values else float("nan")
    errors = sorted({r.error for r in results if not r.ok})
    summary["errors"] = errors[:5]
    return summary
