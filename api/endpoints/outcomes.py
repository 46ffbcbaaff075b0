"""How each way a request can end reaches the client, in one table: a choice's finish_reason, or an error with
its HTTP status (and Retry-After). A JSON answer sends the error as its status and body; a stream that has
started sends the same body as an event."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from api.protocol.errors import APIError
from scheduler.request import Outcome

# The API's own outcome: the request ran past the server's request timeout (the API aborts its sequences).
REQUEST_TIMEOUT: Final = "request_timeout"
Ending = Outcome | Literal["request_timeout"]


@dataclass(frozen=True)
class _Answer:
    finish_reason: str | None = None  # an answer that ends normally: the choice's finish_reason
    status: int = 0  # otherwise the error's HTTP status
    message: str = "{}"  # the error's message; {} is the detail (what went wrong)
    retry_after: str | None = None  # seconds: the server was too busy, or is going away


_ANSWERS: dict[Ending, _Answer] = {
    Outcome.STOPPED: _Answer("stop"),  # EOS, a stop token id or a stop string
    Outcome.LENGTH: _Answer("length"),
    Outcome.ABORTED: _Answer("abort"),  # the client is gone (or its consumer failed): nobody reads this
    Outcome.FAILED: _Answer(status=500, message="generation failed: {}"),
    Outcome.QUEUE_TIMEOUT: _Answer(status=503, retry_after="1"),  # overloaded: another try may be luckier
    Outcome.SHUTDOWN: _Answer(status=503, retry_after="1"),  # another instance, or this one restarted, can take it
    # The client's grammar has a rule that never completes, which compiling could not see (docs/structured_outputs.md).
    Outcome.GRAMMAR_DEAD_END: _Answer(
        status=400, message="the request's grammar allows no token after this point of the answer: it has a dead end"
    ),
    REQUEST_TIMEOUT: _Answer(status=504, message="the request ran longer than the server's request timeout of {} s"),
}


def is_error(ending: Ending) -> bool:
    return _ANSWERS[ending].finish_reason is None


def finish_reason(outcome: Outcome) -> str:
    """The choice's finish_reason, for an outcome that is not an error."""
    reason = _ANSWERS[outcome].finish_reason
    if reason is None:
        raise ValueError(f"{outcome} is an error, not a finish reason")
    return reason


def error(ending: Ending, detail: object) -> APIError:
    """The error an ending that `is_error` answers with; `detail` fills the message."""
    answer = _ANSWERS[ending]
    if answer.finish_reason is not None:
        raise ValueError(f"{ending} is not an error")
    headers = None if answer.retry_after is None else {"Retry-After": answer.retry_after}
    return APIError(answer.status, answer.message.format(detail), headers=headers)
