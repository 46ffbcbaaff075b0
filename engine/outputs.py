"""What the engine hands back after each step."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    """Why a sequence ended; `openai` is the one mapping to the API's finish_reason."""

    STOP = "stop"  # EOS, a stop token id, or (decided by the API) a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client, a disconnect, or shutdown
    ERROR = "error"  # the step that ran it failed

    @property
    def openai(self) -> str:
        return self.value

    @property
    def ended_early(self) -> bool:
        """Aborted or failed: the sequence's cache is freed at once and nothing waits for its batch."""
        return self in (FinishReason.ABORT, FinishReason.ERROR)


@dataclass(frozen=True)
class TokenOutput:
    """One token sampled for one sequence."""

    seq_id: int
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None
    finish_reason: FinishReason | None  # set when this token ends the sequence


@dataclass(frozen=True)
class StepOutput:
    tokens: tuple[TokenOutput, ...]
    num_seqs: int  # sequences computed in the step
    num_tokens: int  # tokens computed in the step (prompt chunks plus decode tokens)
