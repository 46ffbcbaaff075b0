"""A request's lifecycle, timestamps and the events its consumer receives."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.outputs import FinishReason, PromptLogprobs, TokenOutput
from engine.sample.sampling_params import SamplingParams
from engine.spec.ngram_drafter import NgramIndex
from scheduler.draft_length import Acceptance


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # done generating; in dynamic mode it may still be held until its batch ends
    RELEASED = "released"  # its completion was handed to the consumer; it holds nothing any more


@dataclass(frozen=True)
class RequestTimings:
    """Monotonic-clock timestamps (seconds) of one request's life; None where it never got there."""

    mode: str
    arrival: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    released: float
    num_steps: int
    num_preemptions: int
    batch_id: int | None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed
    priority: int = 0  # the request's priority (lower first under --scheduling-policy priority)
    num_draft_tokens: int = 0  # speculation: draft tokens verified for it
    num_accepted_tokens: int = 0  # of those, the ones accepted

    @property
    def queue_time(self) -> float:
        return (self.scheduled if self.scheduled is not None else self.released) - self.arrival

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def held_time(self) -> float:
        """Time between the last token and the release: how long the bus kept a finished answer."""
        return 0.0 if self.last_token is None else self.released - self.last_token

    @property
    def e2e_time(self) -> float:
        return self.released - self.arrival


@dataclass(frozen=True)
class TokenEvent:
    token: TokenOutput
    time: float
    # Another token of this request follows in the same step (a verify step's accepted drafts): a consumer that
    # wakes a reader per event may wait for it, so that the step's tokens reach the reader together.
    more: bool = False


class Outcome(enum.Enum):
    """How a request ended. The engine decides only STOPPED and LENGTH (its `FinishReason`); every other outcome is
    the scheduler's own decision, and the sequence ran no further. The API maps outcomes to HTTP in one table.

    STOPPED: EOS or a stop token id (the engine), or a stop string the API matched.
    LENGTH: max_tokens or the context window was reached.
    ABORTED: cancelled: the client aborted or disconnected, or its event consumer failed.
    FAILED: an internal error: the engine step that ran it failed, or admitting it did.
    QUEUE_TIMEOUT: it waited longer than queue_timeout_s without starting: the server is overloaded.
    SHUTDOWN: the server is shutting down: it never started, or it was unfinished when the grace period ran out.
    GRAMMAR_DEAD_END: the request's grammar allowed no token (a rule that never completes, found only here).
    """

    STOPPED = "stop"
    LENGTH = "length"
    ABORTED = "abort"
    FAILED = "failed"
    QUEUE_TIMEOUT = "queue_timeout"
    SHUTDOWN = "shutdown"
    GRAMMAR_DEAD_END = "grammar_dead_end"

    @classmethod
    def from_engine(cls, reason: FinishReason) -> Outcome:
        return {FinishReason.STOP: cls.STOPPED, FinishReason.LENGTH: cls.LENGTH}.get(reason, cls.GRAMMAR_DEAD_END)

    @property
    def completed(self) -> bool:
        """Ran to a normal end (the answer is whole). Otherwise its cache is freed at once and nothing waits for
        its batch."""
        return self in (Outcome.STOPPED, Outcome.LENGTH)


@dataclass(frozen=True)
class FinishEvent:
    outcome: Outcome
    timings: RequestTimings
    error: str | None = None  # what went wrong, for the outcomes that are errors


@dataclass(frozen=True)
class PromptLogprobsEvent:
    """Scores of prompt positions computed in one step (only for requests with `prompt_logprobs` set). They
    arrive in prompt order, each position once, before that step's TokenEvent."""

    scores: PromptLogprobs
    time: float


RequestEvent = TokenEvent | PromptLogprobsEvent | FinishEvent
EventSink = Callable[[RequestEvent], None]


@dataclass(eq=False)
class SequenceRequest:
    """Scheduler-side state of one sequence. Mutated only by the loop thread after submission."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    sink: EventSink
    arrival: float = 0.0  # reached the server: orders the queue, and latencies count from it
    queued: float = 0.0  # entered the scheduler: the queue and batch timeouts count from it
    seq_id: int = -1
    status: RequestStatus = RequestStatus.WAITING
    outcome: Outcome | None = None
    error: str | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_steps: int = 0
    num_preemptions: int = 0
    batch_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)  # as sampled (the event stream's text)
    seat: int | None = None  # its lane in the event stream (scheduler/events.py): 0..seats-1, the last one held
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    priority: int = 0  # lower runs first under --scheduling-policy priority; ignored under fcfs
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first admitted
    num_draft_tokens: int = 0  # speculation: draft tokens verified for it, over all its steps
    num_accepted_tokens: int = 0  # of those, the ones accepted
    acceptance: Acceptance = field(default_factory=Acceptance)  # its judged drafts, for the draft-length rule
    prediction: Sequence[int] = ()  # Predicted Outputs: the answer the client expects, tokenised (a draft source)
    prediction_offset: int = 0  # the answer's token i stands for the prediction's i + offset (prediction_drafter)
    ngram_index: NgramIndex | None = None  # n-gram speculation: its tokens' n-grams, built at its first draft

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    def timings(self, mode: str, released: float) -> RequestTimings:
        return RequestTimings(
            mode=mode,
            arrival=self.arrival,
            scheduled=self.scheduled,
            first_token=self.first_token,
            last_token=self.last_token,
            released=released,
            num_steps=self.num_steps,
            num_preemptions=self.num_preemptions,
            batch_id=self.batch_id,
            num_cached_tokens=self.num_cached_tokens,
            priority=self.priority,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )
