"""Load generator for any OpenAI-compatible streaming /v1/completions server (and /v1/chat/completions, for the
agent workload's tool turns: agent_chat.py).

Requests are sent open-loop at precomputed offsets (see arrivals.py). `max_concurrency` optionally caps how
many are in flight; a request that waits for a slot starts its clock when it is actually sent, as in vLLM's
benchmark. Every time is in seconds since the run started (perf_counter), so records of one run compare.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.loadgen.agent_chat import ToolCallDeltas, chat_payload, next_turn
from benchmarks.loadgen.sse import DONE, SSEParser
from benchmarks.loadgen.workloads import RequestSpec


class EosPolicy(enum.Enum):
    """How to ask for exactly `max_tokens` output tokens, which servers spell differently."""

    IGNORE_EOS = "ignore_eos"  # vLLM extension, also batchserve and llama-server
    # transformers serve rejects unknown fields such as ignore_eos but takes a generation_config
    HF_MIN_NEW_TOKENS = "hf_min_new_tokens"
    NATURAL = "natural"  # let the model stop at EOS


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str | None = None  # omitted from the request when None; servers then use their default
    temperature: float = 0.0
    seed: int | None = 0  # request i gets seed + i, so sampled runs are reproducible per request
    eos_policy: EosPolicy = EosPolicy.IGNORE_EOS
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    show_progress: bool = True
    progress_label: str = "requests"

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/chat/completions"


@dataclass(frozen=True)
class RequestRecord:
    index: int
    kind: str
    max_tokens: int
    prompt_tokens_est: int
    scheduled_time: float  # when the arrival process released it
    send_time: float  # when it went on the wire (later than scheduled_time if it waited for a slot)
    first_token_time: float | None  # first chunk carrying text
    chunk_times: tuple[float, ...]  # every chunk carrying text, for inter-token latency
    end_time: float  # stream closed
    output_tokens: int  # usage.completion_tokens when reported, else the number of text chunks
    prompt_tokens: int | None  # usage.prompt_tokens when reported
    usage_reported: bool
    server_timings: dict[str, Any] | None  # raw `timings` object of the last chunk, if the server sent one
    finish_reason: str | None
    text: str
    error: str | None
    tool_calls: tuple[dict[str, Any], ...] = ()  # a chat answer's calls, as streamed (the agent workload)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def counted_prompt_tokens(self) -> int:
        """The server's count of the prompt's tokens (usage) where it reported one, else the workload's estimate."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_tokens_est

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, as vLLM defines it."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "max_tokens": self.max_tokens,
            "prompt_tokens_est": self.prompt_tokens_est,
            "scheduled_time": self.scheduled_time,
            "send_time": self.send_time,
            "first_token_time": self.first_token_time,
            "chunk_times": list(self.chunk_times),
            "end_time": self.end_time,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "usage_reported": self.usage_reported,
            "server_timings": self.server_timings,
            "finish_reason": self.finish_reason,
            "text": self.text,
            "error": self.error,
            **({"tool_calls": list(self.tool_calls)} if self.tool_calls else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**{**d, "chunk_times": tuple(d["chunk_times"]), "tool_calls": tuple(d.get("tool_calls", ()))})


@dataclass(frozen=True)
class LoadResult:
    records: tuple[RequestRecord, ...]
    duration_s: float  # first scheduled send to last completion


def build_payload(spec: RequestSpec, config: ClientConfig) -> dict[str, Any]:
    if spec.chat is None:
        request: dict[str, Any] = {"prompt": spec.prompt, "max_tokens": spec.max_tokens}
    else:
        request = chat_payload(spec.chat, spec.max_tokens)
    payload: dict[str, Any] = {
        **request,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.model is not None:
        payload["model"] = config.model
    if config.seed is not None:
        payload["seed"] = config.seed + spec.index
    if spec.priority:
        payload["priority"] = spec.priority
    if spec.chat is not None:  # an agent's turn ends where the model ends it: a call, or its answer
        return payload
    if config.eos_policy is EosPolicy.IGNORE_EOS:
        payload["ignore_eos"] = True
    elif config.eos_policy is EosPolicy.HF_MIN_NEW_TOKENS:
        gen = {"max_new_tokens": spec.max_tokens, "min_new_tokens": spec.max_tokens}
        payload["generation_config"] = json.dumps(gen)
    return payload


async def run_load(specs: Sequence[RequestSpec], offsets: Sequence[float], config: ClientConfig) -> LoadResult:
    if len(specs) != len(offsets):
        raise ValueError(f"{len(specs)} requests but {len(offsets)} arrival offsets")
    in_flight_cap = config.max_concurrency or max(len(specs), 1)
    limits = httpx.Limits(max_connections=in_flight_cap, max_keepalive_connections=in_flight_cap)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    semaphore = asyncio.Semaphore(in_flight_cap)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        with tqdm(total=len(specs), disable=not config.show_progress, desc=config.progress_label) as bar:
            t0 = time.perf_counter()

            sent: dict[int, RequestSpec] = {}  # as sent: a conversation's turn with its whole history
            done: dict[int, RequestRecord] = {}
            finished = {spec.index: asyncio.Event() for spec in specs}

            async def one(spec: RequestSpec, offset: float) -> RequestRecord:
                if spec.follows is None:
                    await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
                else:  # the next turn: the previous prompt, its answer, then the new message
                    follows = spec.follows
                    await finished[follows].wait()
                    answer = done[follows]
                    if spec.chat is not None:
                        spec = next_turn(sent[follows], answer.text, answer.tool_calls, spec)
                    else:
                        spec = dataclasses.replace(spec, prompt=sent[follows].prompt + answer.text + spec.prompt)
                    offset = time.perf_counter() - t0
                sent[spec.index] = spec
                async with semaphore:
                    record = await stream_request(client, spec, config, t0, scheduled_time=offset)
                done[spec.index] = record
                finished[spec.index].set()
                bar.update(1)
                return record

            records = await asyncio.gather(*(one(s, o) for s, o in zip(specs, offsets, strict=True)))
            duration = time.perf_counter() - t0
    return LoadResult(records=tuple(records), duration_s=duration)


async def stream_request(
    client: httpx.AsyncClient, spec: RequestSpec, config: ClientConfig, t0: float, scheduled_time: float
) -> RequestRecord:
    collector = _StreamCollector()
    send_time = time.perf_counter() - t0
    error: str | None = None
    try:
        payload = build_payload(spec, config)
        url = config.completions_url if spec.chat is None else config.chat_url
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                error = f"HTTP {response.status_code}: {body[:300]}"
            else:
                parser = SSEParser()
                async for raw in response.aiter_bytes():
                    now = time.perf_counter() - t0
                    for event in parser.feed(raw):
                        collector.handle(event.data, now)
                for event in parser.close():
                    collector.handle(event.data, time.perf_counter() - t0)
                error = collector.error or collector.completeness_error()
    except (httpx.HTTPError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    end_time = time.perf_counter() - t0
    return collector.to_record(spec, scheduled_time, send_time, end_time, error)


class _StreamCollector:
    """Accumulates what one response stream says."""

    def __init__(self) -> None:
        self.chunk_times: list[float] = []
        self.texts: list[str] = []
        self.tool_calls = ToolCallDeltas()
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.error: str | None = None

    def handle(self, data: str, now: float) -> None:
        if data.strip() == DONE:
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = self.error or f"bad JSON in stream: {data[:200]!r}"
            return
        if not isinstance(obj, dict):
            return
        if obj.get("error"):
            self.error = self.error or f"server error: {json.dumps(obj['error'])[:300]}"
            return
        choices = obj.get("choices") or []
        if choices and isinstance(choices[0], dict):
            delta = choices[0].get("delta")  # a chat chunk: text in delta.content, calls in delta.tool_calls
            delta = delta if isinstance(delta, dict) else {}
            text = choices[0].get("text") or delta.get("content") or ""
            calls = delta.get("tool_calls")
            if text:
                self.texts.append(text)
            if text or (isinstance(calls, list) and self.tool_calls.add(calls)):
                self.chunk_times.append(now)
            if choices[0].get("finish_reason"):
                self.finish_reason = str(choices[0]["finish_reason"])
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]

    def completeness_error(self) -> str | None:
        # Some servers skip [DONE]; a finish_reason still shows the request ran to its end.
        if self.done or self.finish_reason is not None:
            return None
        return "stream ended before [DONE] or a finish_reason"

    def to_record(
        self, spec: RequestSpec, scheduled_time: float, send_time: float, end_time: float, error: str | None
    ) -> RequestRecord:
        completion_tokens = _int_or_none(self.usage, "completion_tokens")
        return RequestRecord(
            index=spec.index,
            kind=spec.kind,
            max_tokens=spec.max_tokens,
            prompt_tokens_est=spec.prompt_tokens,
            scheduled_time=scheduled_time,
            send_time=send_time,
            first_token_time=self.chunk_times[0] if self.chunk_times else None,
            chunk_times=tuple(self.chunk_times),
            end_time=end_time,
            output_tokens=completion_tokens if completion_tokens is not None else len(self.chunk_times),
            prompt_tokens=_int_or_none(self.usage, "prompt_tokens"),
            usage_reported=completion_tokens is not None,
            server_timings=self.timings,
            finish_reason=self.finish_reason,
            text="".join(self.texts),
            error=error,
            tool_calls=self.tool_calls.calls(),
        )


def _int_or_none(d: dict[str, Any] | None, key: str) -> int | None:
    if d is None:
        return None
    value = d.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def discover_model(base_url: str, timeout_s: float = 10.0) -> str | None:
    """First id listed at /v1/models, or None when the server has no such endpoint."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(base_url.rstrip("/") + "/v1/models")
            if response.status_code == 200:
                return str(response.json()["data"][0]["id"])
    return None
