"""OpenAI response and stream-chunk objects for completions and chat completions."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from api.endpoints.timings import timings_json
from api.protocol.deltas import ChoiceDelta, TokenLogprob
from api.text.token_bytes import TokenBytes
from scheduler.request import RequestTimings

if TYPE_CHECKING:  # annotations only: formatting a response needs no transformers import
    from transformers import PreTrainedTokenizerBase


@dataclass
class UsageTally:
    """Usage and the timings of the choice released last, accumulated over a request's choices."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those read from the prefix cache
    completion_tokens: int = 0
    last_timings: RequestTimings | None = None
    num_choices: int = 0
    prompts_counted: set[int] = field(default_factory=set)
    replica: str | None = None  # named in the timings (see timings_json)
    arrival_time: float | None = None  # when the server received the request, Unix seconds
    draft_tokens: int = 0  # speculation, over all choices
    accepted_tokens: int = 0
    predicted: bool = False  # the request had a prediction, the source of its drafts

    def add(self, delta: ChoiceDelta, prompt_index: int) -> None:
        if prompt_index not in self.prompts_counted:  # n choices of one prompt share its tokens
            self.prompts_counted.add(prompt_index)
            self.prompt_tokens += delta.num_prompt_tokens
            self.cached_tokens += delta.timings.num_cached_tokens if delta.timings is not None else 0
        self.completion_tokens += delta.num_output_tokens
        self.num_choices += 1
        if delta.timings is not None:
            self.draft_tokens += delta.timings.num_draft_tokens
            self.accepted_tokens += delta.timings.num_accepted_tokens
        if delta.timings is not None and (
            self.last_timings is None or delta.timings.released >= self.last_timings.released
        ):
            self.last_timings = delta.timings

    def usage(self) -> dict[str, object]:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            **({"completion_tokens_details": self.prediction_details()} if self.predicted else {}),
        }

    def prediction_details(self) -> dict[str, int]:
        """OpenAI's Predicted Outputs counts: predicted tokens the answer took as drafts, and those it did not."""
        rejected = self.draft_tokens - self.accepted_tokens
        return {"accepted_prediction_tokens": self.accepted_tokens, "rejected_prediction_tokens": rejected}

    def timings(self) -> dict[str, object] | None:
        document = timings_json(self.last_timings, self.num_choices, self.replica, self.arrival_time)
        if document is not None:  # the choices' sums, not the last choice's alone
            document |= {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens}
        return document


class ResponseFormatter(ABC):
    """Builds the JSON objects of one response. `CompletionFormatter` and `ChatFormatter` differ only in where
    the text, logprobs and prompt logprobs go; everything else is shared here."""

    object_name: ClassVar[str]  # of the whole response
    chunk_object_name: ClassVar[str]  # of a stream chunk

    def __init__(
        self, request_id: str, model: str, tokenizer: PreTrainedTokenizerBase, tokens_as_ids: bool = False
    ) -> None:
        """`tokens_as_ids`: logprobs name tokens as "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids
        self.created = int(time.time())

    @abstractmethod
    def logprobs(self, entries: Sequence[TokenLogprob], offset: int, top_n: int) -> dict[str, list]:
        """The choice's logprobs object; `offset`: where the entries' text starts in the choice's text."""

    @abstractmethod
    def stream_choice(
        self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object] | None:
        """The choice's part of a chunk; None: this delta shows nothing yet (a tool call's name is incomplete)."""

    @abstractmethod
    def final_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object]: ...

    def opening_choice(self, index: int) -> dict[str, object] | None:
        """What a stream sends for each choice before any text; None: nothing."""
        return None

    @abstractmethod
    def _attach_prompt_logprobs(
        self, response: dict[str, object], scores: Sequence[Sequence[TokenLogprob]], top_n: int
    ) -> None:
        """Put vLLM's prompt_logprobs (per choice, `scores`) where this endpoint has them."""

    def _decoded(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id])
        assert isinstance(text, str)
        return text

    def _token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self._decoded(token_id)

    def prompt_logprobs(self, entries: Sequence[TokenLogprob], top_n: int) -> list[dict[str, dict] | None]:
        """vLLM's prompt_logprobs: per prompt token (the first has none), the token itself and the `top_n` best,
        keyed by token id, each with its logprob, rank and text."""
        result: list[dict[str, dict] | None] = []
        for entry in entries:
            if entry.logprob is None:
                result.append(None)
                continue
            ranked = [(entry.token_id, entry.logprob, entry.rank)]
            ranked += [(token_id, lp, rank) for rank, (token_id, lp) in enumerate(entry.top[:top_n], start=1)]
            result.append(
                {
                    str(token_id): {"logprob": lp, "rank": rank, "decoded_token": self._token_text(token_id)}
                    for token_id, lp, rank in ranked
                }
            )
        return result

    def chunk(self, choices: list[dict[str, object]], **extra: object) -> dict[str, object]:
        base: dict[str, object] = {
            "id": self.request_id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        base.update({k: v for k, v in extra.items() if v is not None})
        return base

    def response(
        self,
        choices: list[dict[str, object]],
        tally: UsageTally,
        prompt_scores: Sequence[Sequence[TokenLogprob]] | None = None,
        prompt_top_n: int = 0,
    ) -> dict[str, object]:
        """`prompt_scores`: per choice, the prompt's scores when the request asked for prompt_logprobs."""
        response: dict[str, object] = {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": tally.usage(),
            "timings": tally.timings(),
        }
        if prompt_scores is not None:
            self._attach_prompt_logprobs(response, prompt_scores, prompt_top_n)
        return response


class CompletionFormatter(ResponseFormatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def logprobs(self, entries: Sequence[TokenLogprob], offset: int, top_n: int) -> dict[str, list]:
        """The legacy shape; a prompt's first token (echo) has a null logprob and null alternatives."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            tokens.append(self._token_text(entry.token_id))
            token_logprobs.append(entry.logprob)
            tops.append(self._top_dict(entry.top[:top_n]) if top_n and entry.logprob is not None else None)
            offsets.append(offset)
            offset += len(self._decoded(entry.token_id))  # offsets count the text, whatever names the token
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _top_dict(self, top: Sequence[tuple[int, float]]) -> dict[str, float]:
        """Text -> logprob, best first. Distinct ids can decode to the same text (e.g. partial UTF-8 bytes all
        read as U+FFFD); the most likely one keeps the key, so the dict stays sorted and holds the chosen token's
        logprob under greedy decoding."""
        result: dict[str, float] = {}
        for token_id, logprob in top:
            result.setdefault(self._token_text(token_id), logprob)
        return result

    def stream_choice(
        self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object] | None:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _attach_prompt_logprobs(
        self, response: dict[str, object], scores: Sequence[Sequence[TokenLogprob]], top_n: int
    ) -> None:
        choices = response["choices"]
        assert isinstance(choices, list)
        for choice, entries in zip(choices, scores, strict=True):
            choice["prompt_logprobs"] = self.prompt_logprobs(entries, top_n)


class ChatFormatter(ResponseFormatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer: PreTrainedTokenizerBase,
        tokens_as_ids: bool = False,
        token_bytes: TokenBytes | None = None,
    ) -> None:
        """`token_bytes`: the server's shared byte lookup for the logprobs' `bytes` (built here if not given)."""
        super().__init__(request_id, model, tokenizer, tokens_as_ids)
        self._token_bytes = token_bytes or TokenBytes(tokenizer)

    def logprobs(self, entries: Sequence[TokenLogprob], offset: int, top_n: int) -> dict[str, list]:
        def item(token_id: int, logprob: float | None) -> dict[str, object]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(self._token_bytes(token_id))}

        content = [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:top_n]]} for e in entries
        ]
        return {"content": content}

    def opening_choice(self, index: int) -> dict[str, object] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def stream_choice(
        self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object] | None:
        delta = {} if text is None else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object]:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _attach_prompt_logprobs(
        self, response: dict[str, object], scores: Sequence[Sequence[TokenLogprob]], top_n: int
    ) -> None:
        # One prompt for all choices: vLLM puts its scores on the response, not on a choice.
        response["prompt_logprobs"] = self.prompt_logprobs(scores[0], top_n)
