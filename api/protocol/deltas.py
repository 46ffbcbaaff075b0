"""What the generation service hands the formatters: a choice's input and its output deltas. Plain data, so the
response formatters need neither the service nor the scheduler loop behind it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from api.protocol.errors import APIError
from engine.sample.sampling_params import SamplingParams
from scheduler.request import RequestTimings


@dataclass(frozen=True)
class OutputOptions:
    """How a choice's tokens become text: stop strings and vLLM's detokenisation options."""

    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only slow tokenizers space special tokens; as vLLM, else a no-op
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # stop strings are matched only from this many output tokens on
    discard_output: bool = False  # max_tokens 0: the one token the engine samples is not part of the answer


@dataclass(frozen=True)
class ChoiceInput:
    prompt_token_ids: list[int]
    params: SamplingParams
    output: OutputOptions = OutputOptions()
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    priority: int = 0  # lower first under --scheduling-policy priority
    prediction: tuple[int, ...] = ()  # Predicted Outputs: drafts for the answer, tokenised


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob with the best alternatives; `logprob` None for a prompt's first token.
    `rank` (1 = most likely) is known for prompt tokens."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]
    rank: int | None = None


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice: text, the tokens behind it, and its end when it is released."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the whole prompt's, on the choice's first delta
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended the choice, if one did (vLLM's stop_reason)
    timings: RequestTimings | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: APIError | None = None  # the choice failed: what to answer instead (see api.endpoints.outcomes)

    def extends(self, later: ChoiceDelta) -> bool:
        """Whether `later` continues this delta's text in one chunk: the same choice, and neither ends it."""
        open_ended = self.finish_reason is None and self.error is None
        return open_ended and later.index == self.index and later.finish_reason is None and later.error is None

    def then(self, later: ChoiceDelta) -> ChoiceDelta:
        """This delta and `later` (which it `extends`) as one: their text and token logprobs in order."""
        return dataclasses.replace(
            self,
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
            prompt_logprobs=self.prompt_logprobs + later.prompt_logprobs,
            num_output_tokens=later.num_output_tokens,
        )
