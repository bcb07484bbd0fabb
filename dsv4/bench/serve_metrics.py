"""Aggregate request outcomes into the figures `vllm bench serve` reports, and print them.

Only successful requests contribute tokens and latencies; throughputs divide by the wall
time of the whole run. Latencies are reported in milliseconds; ITL pools every gap of
every request, TPOT takes one value per request with at least two output tokens.
"""
from __future__ import annotations

from typing import Any, Sequence

from dsv4.bench.sse_client import RequestOutcome

LATENCIES = (("ttft", "Time to First Token", "TTFT"),
             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"),
             ("e2el", "End-to-end Latency", "E2EL"))
STATISTICS = (("mean", "Mean"), ("median", "Median"), ("p99", "P99"))
MAX_ERRORS_KEPT = 10


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between order statistics, like
    numpy's default; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(outcomes: Sequence[RequestOutcome], duration: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.success]
    input_tokens = sum(o.prompt_tokens for o in done)
    output_tokens = sum(o.output_tokens for o in done)
    cached_tokens = sum(o.cached_tokens for o in done)
    per_second = 1.0 / duration if duration > 0 else 0.0
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": cached_tokens,
        "prefix_cache_hit_rate": cached_tokens / input_tokens if input_tokens else 0.0,
        "request_throughput": len(done) * per_second,
        "output_throughput": output_tokens * per_second,
        "total_token_throughput": (input_tokens + output_tokens) * per_second,
    }
    samples = {"ttft": [o.ttft for o in done], "tpot": [o.tpot for o in done if o.tpot is not None],
               "itl": [gap for o in done for gap in o.itl], "e2el": [o.latency for o in done]}
    for metric, values in samples.items():
        ms = [v * 1000 for v in values]
        summary[f"mean_{metric}_ms"] = sum(ms) / len(ms) if ms else 0.0
        summary[f"median_{metric}_ms"] = percentile(ms, 50)
        summary[f"p99_{metric}_ms"] = percentile(ms, 99)
    summary["first_ttft_ms"] = outcomes[0].ttft * 1000 if outcomes and outcomes[0].success else None
    summary["errors"] = [o.error for o in outcomes if not o.success][:MAX_ERRORS_KEPT]
    return summary


def format_table(summary: dict[str, Any]) -> str:
    rows = [("Successful requests:", summary["completed"]),
            ("Failed requests:", summary["failed"]),
            ("Benchmark duration (s):", summary["duration"]),
            ("Total input tokens:", summary["total_input_tokens"]),
            ("Total generated tokens:", summary["total_output_tokens"]),
            ("Prefix cache hit rate:", summary["prefix_cache_hit_rate"]),
            ("Request throughput (req/s):", summary["request_throughput"]),
            ("Output token throughput (tok/s):", summary["output_throughput"]),
            ("Total token throughput (tok/s):", summary["total_token_throughput"])]
    lines = [_rule(" Serving Benchmark Result ", "=")] + [_row(*r) for r in rows]
    for metric, title, short in LATENCIES:
        lines.append(_rule(title, "-"))
        lines += [_row(f"{label} {short} (ms):", summary[f"{stat}_{metric}_ms"]) for stat, label in STATISTICS]
    if "mean_ttft_ms_by_turn" in summary:
        lines.append(_rule("Per turn", "-"))
        lines += [_row(f"Turn {k + 1} mean TTFT (ms), hit rate:", f"{t:.2f}, {r:.2f}")
                  for k, (t, r) in enumerate(zip(summary["mean_ttft_ms_by_turn"],
                                                 summary["prefix_cache_hit_rate_by_turn"]))]
    lines.append("=" * 50)
    if summary["errors"]:
        lines.append("First errors:")
        lines += [f"  {e}" for e in summary["errors"]]
    return "\n".join(lines)


def _row(label: str, value: Any) -> str:
    shown = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {shown:>9}"


def _rule(title: str, fill: str) -> str:
    return title.center(50, fill)
