"""Plain-text summary of one run, laid out like `vllm bench serve` prints it."""

from __future__ import annotations

from benchmarks.loadgen.run import RunResult

_WIDTH = 60
_LABEL = 42


def format_run(result: RunResult) -> str:
    s = result.summary
    rows: list[tuple[str, str] | str] = [
        ("Successful requests:", str(s.completed)),
        ("Failed requests:", str(s.failed)),
        ("Request rate (req/s):", f"{result.request_rate:g}"),
        ("Benchmark duration (s):", f"{s.duration_s:.2f}"),
        ("Total input tokens:", str(s.input_tokens)),
        ("Total generated tokens:", str(s.output_tokens)),
        ("Request throughput (req/s):", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{s.total_token_throughput:.2f}"),
    ]
    if s.goodput is not None:
        rows.append(("Request goodput (req/s):", f"{s.goodput:.2f}"))
    for title, dist in (
        ("Time to First Token", s.ttft_ms),
        ("Time per Output Token (excl. 1st token)", s.tpot_ms),
        ("Inter-token Latency", s.itl_ms),
        ("End-to-end Latency", s.e2e_ms),
        ("Server queue time", s.queue_ms),
        ("Server held time (finished, not released)", s.held_ms),
    ):
        if dist is not None:
            rows.append(f" {title} ".center(_WIDTH, "-"))
            rows += [
                ("Mean (ms):", f"{dist.mean:.2f}"),
                ("P50 (ms):", f"{dist.p50:.2f}"),
                ("P90 (ms):", f"{dist.p90:.2f}"),
                ("P99 (ms):", f"{dist.p99:.2f}"),
            ]
    m = result.server_metrics
    if m is not None:
        rows.append(" Server /metrics (delta over the run) ".center(_WIDTH, "-"))
        rows += [
            ("Engine steps:", _fmt(m.steps, ".0f")),
            ("Mean batch size (seqs/step):", _fmt(m.mean_batch_size, ".2f")),
            ("Held seat-steps:", _fmt(m.held_seats, ".0f")),
        ]
    rows += [f"error: {error}" for error in s.errors]
    lines = [f" {result.label} ".center(_WIDTH, "=")]
    for item in rows:
        lines.append(item if isinstance(item, str) else f"{item[0]:<{_LABEL}}{item[1]:>{_WIDTH - _LABEL}}")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
