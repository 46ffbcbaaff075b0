"""Prometheus metrics with vLLM-compatible names and a `mode` label, in a registry owned by the app.

Under --scheduling-policy priority, three more families split queue time, TTFT and preemptions by priority class
(label `priority`); the vLLM names stay as they are, one series per mode, so existing dashboards keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from scheduler.request import RequestTimings
from scheduler.stats import StepStats

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
# A priority is any integer; its label is the value from -PRIORITY_LABEL_LIMIT to PRIORITY_LABEL_LIMIT and one
# open class beyond each end, so a client that sends many distinct priorities cannot grow the series without bound.
PRIORITY_LABEL_LIMIT = 10


def priority_label(priority: int) -> str:
    if priority > PRIORITY_LABEL_LIMIT:
        return f">{PRIORITY_LABEL_LIMIT}"
    if priority < -PRIORITY_LABEL_LIMIT:
        return f"<-{PRIORITY_LABEL_LIMIT}"
    return str(priority)


class ServerMetrics:
    def __init__(self, mode: str, model_name: str, by_priority: bool = False, prefix_caching: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.prefix_caching = prefix_caching  # off: nothing is looked up, so no prefix-cache queries are counted
        self._labels = {"mode": mode, "model_name": model_name}
        names = list(self._labels)

        def histogram(
            name: str, doc: str, buckets: Sequence[float] = _LATENCY_BUCKETS, extra: Sequence[str] = ()
        ) -> Histogram:
            return Histogram(name, doc, [*names, *extra], buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to release of the completion")
        self.queue = histogram("vllm:request_queue_time_seconds", "Time spent waiting before the first step")
        self.held = histogram("batchserve:request_held_time_seconds", "Last token to release (dynamic batching)")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified")
        self.accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens the model's own choice matched"
        )
        self.drafts = counter("vllm:spec_decode_num_drafts", "Speculative drafts verified (one per sequence and step)")
        self.accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative drafts whose token at this position (0-based) was accepted",
            [*names, "position"],
            registry=self.registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self.failures = counter("batchserve:request_failures", "Requests failed by an internal error")
        self.policy_fallbacks = counter(
            "batchserve:policy_fallbacks",
            "Times the scheduling policy raised, blamed no request, and the mode's built-in policy took over",
        )
        self.batch_size = histogram("batchserve:batch_size", "Sequences computed per engine step", _BATCH_BUCKETS)
        self.step_tokens = histogram(
            "batchserve:step_tokens",
            "Tokens computed per engine step",
            (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
        )
        self.held_seats = counter("batchserve:held_seats", "Seat-steps held by finished, unreleased sequences")
        self.steps = counter("batchserve:steps", "Engine steps")
        self.running = Gauge("vllm:num_requests_running", "Requests running", names, registry=self.registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", names, registry=self.registry)
        self.cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache blocks in use (0..1)", names, registry=self.registry
        )
        self.cache_cached_free = Gauge(
            "batchserve:kv_cache_cached_free_perc",
            "KV cache blocks free to take but still holding a cached prefix (0..1)",
            names,
            registry=self.registry,
        )
        self.tool_calls = Counter(
            "batchserve:tool_calls",
            "Chat answers' tool calls by parser and outcome: parsed (a whole call), unfinished (the answer ended "
            "inside one), no_call (an answer that could call a tool and called none); parser `forced` counts "
            "tool_choice required and named calls",
            [*names, "parser", "outcome"],
            registry=self.registry,
        )
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.by_priority = by_priority
        if by_priority:  # per priority class; a class's series appear with its first request, "0" at once
            self.priority_queue = histogram(
                "batchserve:request_queue_time_by_priority_seconds",
                "Time spent waiting before the first step, by priority class",
                extra=("priority",),
            )
            self.priority_ttft = histogram(
                "batchserve:time_to_first_token_by_priority_seconds",
                "Time to first token, by priority class",
                extra=("priority",),
            )
            self.priority_preemptions = Counter(
                "batchserve:request_preemptions_by_priority",
                "Preemptions of finished requests, by priority class",
                [*names, "priority"],
                registry=self.registry,
            )
            for metric in (self.priority_queue, self.priority_ttft, self.priority_preemptions):
                metric.labels(**self._labels, priority="0")
        # Create every labelled series now, so scrapes see zeros instead of missing series.
        for metric in (
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
            self.held,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.failures,
            self.policy_fallbacks,
            self.batch_size,
            self.step_tokens,
            self.held_seats,
            self.steps,
        ):
            metric.labels(**self._labels)

    def bind_gauges(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        cache_usage: Callable[[], float],
        cache_cached_free: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """Gauges read live state at scrape time, so they are right between steps too."""
        self.running.labels(**self._labels).set_function(running)
        self.waiting.labels(**self._labels).set_function(waiting)
        self.cache_usage.labels(**self._labels).set_function(cache_usage)
        self.cache_cached_free.labels(**self._labels).set_function(cache_cached_free)

    def observe_step(self, stats: StepStats) -> None:
        labels = self._labels
        self.steps.labels(**labels).inc()
        self.batch_size.labels(**labels).observe(stats.num_seqs)
        self.step_tokens.labels(**labels).observe(stats.num_tokens)
        if stats.held_seats:
            self.held_seats.labels(**labels).inc(stats.held_seats)
        if stats.num_draft_tokens:
            self.draft_tokens.labels(**labels).inc(stats.num_draft_tokens)
            self.accepted_tokens.labels(**labels).inc(stats.num_accepted_tokens)
            self.drafts.labels(**labels).inc(stats.num_drafts)
            for position, count in enumerate(stats.accepted_per_pos):
                self.accepted_per_pos.labels(**labels, position=str(position)).inc(count)

    def observe_request(
        self,
        timings: RequestTimings,
        num_prompt_tokens: int,
        num_output_tokens: int,
        inter_token_latencies: Sequence[float],
        finish_reason: str,
    ) -> None:
        labels = self._labels
        if timings.time_to_first_token is not None:
            self.ttft.labels(**labels).observe(timings.time_to_first_token)
        itl = self.itl.labels(**labels)
        for latency in inter_token_latencies:
            itl.observe(latency)
        self.e2e.labels(**labels).observe(timings.e2e_time)
        self.queue.labels(**labels).observe(timings.queue_time)
        self.held.labels(**labels).observe(timings.held_time)
        self.prompt_tokens.labels(**labels).inc(num_prompt_tokens)
        if self.prefix_caching:
            self.prefix_queries.labels(**labels).inc(num_prompt_tokens)
        self.prefix_hits.labels(**labels).inc(timings.num_cached_tokens)
        self.generation_tokens.labels(**labels).inc(num_output_tokens)
        self.success.labels(**labels, finished_reason=finish_reason).inc()
        if self.by_priority:
            by_class = {**labels, "priority": priority_label(timings.priority)}
            self.priority_queue.labels(**by_class).observe(timings.queue_time)
            if timings.time_to_first_token is not None:
                self.priority_ttft.labels(**by_class).observe(timings.time_to_first_token)
            self.priority_preemptions.labels(**by_class).inc(timings.num_preemptions)

    def observe_tool_calls(self, parser: str, outcome: str, count: int = 1) -> None:
        self.tool_calls.labels(**self._labels, parser=parser, outcome=outcome).inc(count)

    def expect_tool_parser(self, parser: str) -> None:
        """Create the parser's series (and forced calls'), so scrapes see zeros before the first call."""
        for name in (parser, "forced"):
            for outcome in ("parsed", "unfinished", "no_call"):
                self.tool_calls.labels(**self._labels, parser=name, outcome=outcome)

    def observe_failure(self) -> None:
        self.failures.labels(**self._labels).inc()

    def observe_policy_fallback(self) -> None:
        self.policy_fallbacks.labels(**self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
