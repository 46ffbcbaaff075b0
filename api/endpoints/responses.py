"""A generation's deltas as one JSON response (`collect`) or as server-sent events (`stream`)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from api.endpoints.formatting import ResponseFormatter, UsageTally
from api.endpoints.service import Generation
from api.protocol.deltas import ChoiceDelta, TokenLogprob
from api.protocol.errors import APIError

logger = logging.getLogger("batchserve.api")


@dataclass(frozen=True)
class ResponseShape:
    """How one request's response looks: its formatter, and what it shows beside each choice's generated text."""

    formatter: ResponseFormatter
    n: int
    echo_texts: list[str] | None  # per prompt: text the answer starts with (completions echo, chat echo)
    logprobs: int | None  # alternatives per generated token; None: no logprobs
    echo_logprobs: bool  # completions: the prompt's logprobs come first, as the legacy API echoes them
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field
    include_usage: bool
    continuous_usage: bool
    replica: str | None = None  # which replica serves it, behind a proxy (api.scale_out.ray_serve)
    arrival_time: float | None = None  # when the server received it, Unix seconds
    predicted: bool = False  # it came with a prediction: usage counts the predicted tokens accepted and rejected

    def echo_text(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts else ""

    def logprobs_json(self, entries: Sequence[TokenLogprob], offset: int) -> dict[str, list] | None:
        return None if self.logprobs is None else self.formatter.logprobs(entries, offset, self.logprobs)


async def collect(generation: Generation, shape: ResponseShape) -> dict[str, object]:
    """The whole response; a failed choice raises its error (see api.endpoints.outcomes)."""
    count = len(generation.choices)
    texts = [shape.echo_text(i) for i in range(count)]
    entries: list[list[TokenLogprob]] = [[] for _ in range(count)]
    prompt_scores: list[tuple[TokenLogprob, ...]] = [() for _ in range(count)]
    finish: list[str | None] = [None] * count
    stop_reasons: list[str | None] = [None] * count
    tally = UsageTally(replica=shape.replica, arrival_time=shape.arrival_time, predicted=shape.predicted)
    async for delta in generation.deltas():
        if delta.error is not None:
            raise delta.error
        texts[delta.index] += delta.text
        if delta.prompt_logprobs:
            prompt_scores[delta.index] = delta.prompt_logprobs
            if shape.echo_logprobs:  # the echoed prompt's tokens lead the completion's
                entries[delta.index][:0] = delta.prompt_logprobs
        entries[delta.index].extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish[delta.index] = delta.finish_reason
            stop_reasons[delta.index] = delta.stop_reason
            tally.add(delta, delta.index // shape.n)
    formatter = shape.formatter
    choices = [formatter.final_choice(i, texts[i], finish[i], shape.logprobs_json(entries[i], 0)) for i in range(count)]
    for choice, stop_reason in zip(choices, stop_reasons, strict=True):
        choice["stop_reason"] = stop_reason  # vLLM's: the stop string that ended it; null for EOS and the rest
    if shape.prompt_logprobs is None:
        return formatter.response(choices, tally)
    return formatter.response(choices, tally, prompt_scores, shape.prompt_logprobs)


async def stream(generation: Generation, shape: ResponseShape) -> AsyncGenerator[str, None]:
    """The response's SSE data lines, then [DONE]. An error after the stream started is sent as an event."""
    events = _StreamEvents(generation, shape)
    try:
        for index in range(len(generation.choices)):
            for event in events.opening(index):
                yield event
        async for delta in generation.deltas():
            if delta.error is not None:
                yield json.dumps(delta.error.body())
                break
            for event in events.on_delta(delta):
                yield event
        else:
            if shape.include_usage:  # as OpenAI: usage comes once, in a closing chunk without choices
                yield events.chunk([], usage=events.tally.usage(), timings=events.tally.timings())
    except APIError as exc:  # e.g. the request timeout, after the stream started
        yield json.dumps(exc.body())
    except Exception:  # the stream has started: report the fault in-band, then end it properly
        logger.exception("streaming %s failed", shape.formatter.request_id)
        yield json.dumps(APIError(500, "internal server error while streaming").body())
    finally:
        generation.close()
    yield "[DONE]"


class _StreamEvents:
    """The chunks of one stream, with what they count as it goes: text offsets, output tokens, usage."""

    def __init__(self, generation: Generation, shape: ResponseShape) -> None:
        count = len(generation.choices)
        self.shape = shape
        self.formatter = shape.formatter
        self.offsets = [0] * count  # where each choice's next text starts (completions' text_offset)
        self.generated = [0] * count
        self.finished = 0
        self.tally = UsageTally(replica=shape.replica, arrival_time=shape.arrival_time, predicted=shape.predicted)
        self.prompt_tokens = sum(len(c.prompt_token_ids) for c in generation.choices[:: shape.n])

    def chunk(self, choices: list[dict[str, object]], **extra: object) -> str:
        data = self.formatter.chunk(choices, **extra)
        if self.shape.continuous_usage and "usage" not in extra:  # vLLM: usage so far on every chunk
            done = sum(self.generated)
            data["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done,
            }
        elif self.shape.include_usage:  # as OpenAI: every chunk has the field, null until the closing one
            data.setdefault("usage", None)
        return json.dumps(data)

    def echo(self, index: int, prompt_scores: Sequence[TokenLogprob] = ()) -> str:
        text = self.shape.echo_text(index)
        self.offsets[index] = len(text)
        lp = self.formatter.logprobs(prompt_scores, 0, self.shape.logprobs or 0) if prompt_scores else None
        choice = self.formatter.stream_choice(index, text, None, lp)
        return self.chunk([choice] if choice is not None else [])

    def opening(self, index: int) -> list[str]:
        """Before any token: the formatter's opening (chat's role), then the echo unless it waits for scores."""
        events = []
        opening = self.formatter.opening_choice(index)
        if opening is not None:
            events.append(self.chunk([opening]))
        if self.shape.echo_texts and not self.shape.echo_logprobs:
            events.append(self.echo(index))
        return events

    def on_delta(self, delta: ChoiceDelta) -> list[str]:
        events = []
        index = delta.index
        if delta.prompt_logprobs and self.shape.echo_logprobs:  # the prompt's scores exist once it is prefilled
            events.append(self.echo(index, delta.prompt_logprobs))
        self.generated[index] = delta.num_output_tokens or self.generated[index]
        if delta.finish_reason is not None:
            self.finished += 1
            self.tally.add(delta, index // self.shape.n)
        if not delta.text and not delta.logprobs and delta.finish_reason is None:
            return events
        lp = self.shape.logprobs_json(delta.logprobs, self.offsets[index]) if delta.logprobs else None
        self.offsets[index] += len(delta.text)
        choice = self.formatter.stream_choice(index, delta.text, delta.finish_reason, lp)
        if choice is not None and delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason  # on the choice's last chunk, as in the whole response
        if choice is not None:
            events.append(self.chunk([choice], **self._closing(delta)))
        return events

    def _closing(self, delta: ChoiceDelta) -> dict[str, object]:
        """The last choice's chunk carries the timings, and the usage unless a closing chunk will."""
        if delta.finish_reason is None or self.finished < len(self.offsets):
            return {}
        if self.shape.include_usage:
            return {"timings": self.tally.timings()}
        return {"usage": self.tally.usage(), "timings": self.tally.timings()}
