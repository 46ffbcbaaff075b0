"""Between HTTP and the scheduler: tokenise, submit one sequence per choice, turn events into text deltas.

Each choice is a scheduler request whose events arrive through a shared asyncio queue. Text is produced by
an incremental detokenizer per choice, which also finds stop strings; a stop string finishes the sequence
early through the scheduler (in dynamic mode its completion is still held until the batch ends).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from api.endpoints import outcomes
from api.endpoints.metrics import ServerMetrics
from api.protocol.deltas import ChoiceDelta, ChoiceInput, OutputOptions, TokenLogprob
from api.protocol.engine_fields import engine_input_error
from api.protocol.errors import APIError
from api.text.detokenizer import IncrementalDetokenizer
from engine.errors import EngineInputError
from scheduler.errors import EngineLoopStoppedError, QueueFullError, SchedulerClosedError
from scheduler.loop import SchedulerLoop
from scheduler.request import (
    FinishEvent,
    Outcome,
    PromptLogprobsEvent,
    RequestEvent,
    SequenceRequest,
    TokenEvent,
)


@dataclass
class _Choice:
    index: int
    request_id: str
    detokenizer: IncrementalDetokenizer
    prompt_token_ids: list[int]
    output: OutputOptions
    num_output_tokens: int = 0
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    prompt_scores_sent: bool = False
    stopped_by_string: bool = False
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)


class GenerationService:
    def __init__(
        self,
        loop: SchedulerLoop,
        tokenizer: PreTrainedTokenizerBase,
        metrics: ServerMetrics,
        request_timeout_s: float | None = None,
    ) -> None:
        self.loop = loop
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:24]}"

    def start(self, inputs: Sequence[ChoiceInput], request_id: str, arrival: float | None = None) -> Generation:
        """Submit every choice now, so that bad input or a full queue fail before any response is sent.

        `arrival`: when the HTTP request came in, on the scheduler's clock (`now()`); orders the queue."""
        generation = Generation(self, request_id, arrival)
        try:
            for item in inputs:
                generation.add(item)
        except BaseException:
            generation.close()
            raise
        return generation

    def now(self) -> float:
        return self.loop.scheduler.clock()

    def _submit(self, request: SequenceRequest, arrival: float | None) -> None:
        try:
            self.loop.submit(request, arrival)
        except EngineInputError as exc:
            raise engine_input_error(exc) from None
        except QueueFullError as exc:
            raise APIError(429, f"{exc}; retry later", headers={"Retry-After": "1"}) from None
        except EngineLoopStoppedError as exc:  # for good: retrying here cannot help, another instance can
            raise APIError(503, f"{exc}; this server cannot serve requests") from None
        except SchedulerClosedError as exc:  # draining: another instance, or this one restarted, can take it
            raise APIError(503, f"{exc}; retry shortly", headers={"Retry-After": "5"}) from None

    def _on_prompt_scores(self, choice: _Choice, event: PromptLogprobsEvent) -> None:
        scores = event.scores
        if not choice.prompt_scores:
            choice.prompt_scores.append(TokenLogprob(choice.prompt_token_ids[0], None, ()))
        choice.prompt_scores.extend(
            TokenLogprob(token_id, logprob, top, rank)
            for token_id, logprob, rank, top in zip(
                scores.token_ids, scores.logprobs, scores.ranks, scores.top, strict=True
            )
        )

    def _take_prompt_scores(self, choice: _Choice) -> tuple[TokenLogprob, ...]:
        """The prompt's scores, once: they go out with the choice's first delta, when the prefill is done."""
        if choice.prompt_scores_sent or not choice.prompt_scores:
            return ()
        choice.prompt_scores_sent = True
        return tuple(choice.prompt_scores)

    def _on_token(self, choice: _Choice, event: TokenEvent) -> ChoiceDelta | None:
        if choice.stopped_by_string:
            return None  # tokens computed before the stop reached the loop are not part of the answer
        prompt_scores = self._take_prompt_scores(choice)
        if choice.output.discard_output:  # max_tokens 0: only the prompt's scores are the answer
            return ChoiceDelta(choice.index, "", prompt_logprobs=prompt_scores) if prompt_scores else None
        token = event.token
        if choice.last_token_time is not None:
            choice.inter_token_latencies.append(event.time - choice.last_token_time)
        choice.last_token_time = event.time
        choice.num_output_tokens += 1
        match_stops = choice.num_output_tokens > choice.output.min_tokens
        text = choice.detokenizer.push([token.token_id], match_stops=match_stops)
        if choice.detokenizer.stopped:
            choice.stopped_by_string = True
            self.loop.stop_request(choice.request_id)
        logprobs: tuple[TokenLogprob, ...] = ()
        if token.logprob is not None:
            logprobs = (TokenLogprob(token.token_id, token.logprob, token.top_logprobs or ()),)
        return ChoiceDelta(choice.index, text, logprobs, prompt_scores, num_output_tokens=choice.num_output_tokens)

    def _on_finish(self, choice: _Choice, event: FinishEvent) -> ChoiceDelta:
        if outcomes.is_error(event.outcome):
            self.metrics.observe_failure()
            return ChoiceDelta(choice.index, "", error=outcomes.error(event.outcome, event.error or "internal error"))
        tail = "" if choice.stopped_by_string or choice.output.discard_output else choice.detokenizer.flush()
        # The flush can match a stop string too (through the U+FFFD of a character max_tokens cut in half).
        stopped = choice.stopped_by_string or choice.detokenizer.stopped
        reason = outcomes.finish_reason(Outcome.STOPPED if stopped else event.outcome)
        num_prompt_tokens = len(choice.prompt_token_ids)
        self.metrics.observe_request(
            event.timings, num_prompt_tokens, choice.num_output_tokens, choice.inter_token_latencies, reason
        )
        return ChoiceDelta(
            choice.index,
            tail,
            prompt_logprobs=self._take_prompt_scores(choice),
            finish_reason=reason,
            stop_reason=choice.detokenizer.stop_reason,
            timings=event.timings,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=choice.num_output_tokens,
        )


class Generation:
    """The running choices of one API request. Iterate for deltas; `close()` aborts whatever still runs."""

    def __init__(self, service: GenerationService, request_id: str, arrival: float | None = None) -> None:
        self.service = service
        self.request_id = request_id
        self.arrival = arrival
        self.choices: list[_Choice] = []
        self._open: set[str] = set()
        self._events: asyncio.Queue[tuple[int, RequestEvent]] = asyncio.Queue()
        self._aio_loop = asyncio.get_running_loop()

    def add(self, item: ChoiceInput) -> None:
        index = len(self.choices)
        sub_id = f"{self.request_id}-{index}"
        options = item.output
        detokenizer = IncrementalDetokenizer(
            self.service.tokenizer,
            stop=options.stop,
            skip_special_tokens=options.skip_special_tokens,
            include_stop_str_in_output=options.include_stop_str_in_output,
        )
        self.choices.append(_Choice(index, sub_id, detokenizer, item.prompt_token_ids, options))

        held: list[tuple[int, RequestEvent]] = []  # this choice's events of the step so far (the loop thread's)

        def sink(event: RequestEvent) -> None:
            # One wake-up per step, not per token: each wake-up's write releases the GIL, and the stream would
            # take the step's tokens one by one, a chunk and a socket write each.
            held.append((index, event))
            if isinstance(event, TokenEvent) and event.more:
                return
            events = held.copy()
            held.clear()
            self._aio_loop.call_soon_threadsafe(self._receive, events)

        request = SequenceRequest(
            sub_id,
            item.prompt_token_ids,
            item.params,
            sink,
            cache_salt=item.cache_salt,
            priority=item.priority,
            prediction=item.prediction,
        )
        self.service._submit(request, self.arrival)
        self._open.add(sub_id)

    def _receive(self, events: list[tuple[int, RequestEvent]]) -> None:
        for item in events:
            self._events.put_nowait(item)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choices' deltas as their events arrive. Events already queued when the loop gets to them (a
        speculative step's several tokens, or steps that ran while a slow client was written to) go out as one
        delta per choice, as vLLM's output collector merges them: one chunk, one socket write, instead of one per
        token. Each token still passes the detokenizer and stop strings on its own; a choice's end stays a delta
        of its own, after its text."""
        service = self.service
        try:
            async with asyncio.timeout(service.request_timeout_s):
                while self._open:
                    events = [await self._events.get()]
                    while not self._events.empty():
                        events.append(self._events.get_nowait())
                    pending: dict[int, ChoiceDelta] = {}  # by choice: its deltas so far in this batch, merged
                    for index, event in events:
                        delta = self._delta(index, event)
                        if delta is None:
                            continue
                        earlier = pending.pop(index, None)
                        if earlier is not None and earlier.extends(delta):
                            delta = earlier.then(delta)
                        elif earlier is not None:
                            yield earlier
                        pending[index] = delta
                    for delta in pending.values():
                        yield delta
        except TimeoutError:
            raise outcomes.error(outcomes.REQUEST_TIMEOUT, service.request_timeout_s) from None
        finally:
            self.close()

    def _delta(self, index: int, event: RequestEvent) -> ChoiceDelta | None:
        """What one event adds to its choice's output (None: nothing to send yet)."""
        service = self.service
        choice = self.choices[index]
        if isinstance(event, TokenEvent):
            return service._on_token(choice, event)
        if isinstance(event, FinishEvent):
            self._open.discard(choice.request_id)
            return service._on_finish(choice, event)
        service._on_prompt_scores(choice, event)
        return None

    def close(self) -> None:
        """Abort the choices still running (client gone, timeout, error); their seats free within a step."""
        for sub_id in self._open:
            self.service.loop.abort(sub_id)
        self._open.clear()
