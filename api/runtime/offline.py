"""A synchronous offline API for scripts and tests: `LLM(model=..., mode=...).generate(prompts, params)`."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from api.config import RuntimeOptions
from api.runtime.build import build_model_runtime, load
from api.text.chat_template import encode_chat
from api.text.detokenizer import IncrementalDetokenizer
from engine.outputs import PromptLogprobs
from engine.platform.compute_thread import run_on_passing_thread
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import LoadedModel
from scheduler.request import (
    FinishEvent,
    Outcome,
    PromptLogprobsEvent,
    RequestEvent,
    RequestTimings,
    SequenceRequest,
    TokenEvent,
)


@dataclass(frozen=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Outcome
    timings: RequestTimings
    # With SamplingParams.prompt_logprobs: every prompt position from 1 on (position 0 has no logprob).
    prompt_logprobs: PromptLogprobs | None = None


class LLM:
    """Loads a model and runs the chosen batching policy on a background loop thread."""

    def __init__(
        self,
        model: str | None = None,
        mode: str = "continuous",
        loaded: LoadedModel | None = None,
        **options: Any,
    ) -> None:
        """`options`: ServerConfig's scheduler and engine options by name (max_num_seqs, device, ...)."""
        self.options = RuntimeOptions.of(mode, model=model, **options)
        # Loading and building on a thread that ends keeps the loop thread's OpenMP workers fast (see there).
        self.loaded = loaded or run_on_passing_thread(lambda: load(self.options))
        self.runtime = run_on_passing_thread(lambda: build_model_runtime(self.options, self.loaded))
        self.tokenizer = self.loaded.tokenizer
        self.runtime.loop.start()
        self._next_id = 0

    def generate(
        self, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams], chat: bool = False
    ) -> list[CompletionOutput]:
        """Submit all prompts at once (so they batch), block until every one is released."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        events: queue.Queue[tuple[int, RequestEvent]] = queue.Queue()
        ids = [self._encode(p, chat) for p in prompts]
        for index, (prompt_ids, p) in enumerate(zip(ids, params_list, strict=True)):
            self._next_id += 1

            def sink(event: RequestEvent, index: int = index) -> None:
                events.put((index, event))

            self.runtime.loop.submit(SequenceRequest(f"offline-{self._next_id}", prompt_ids, p, sink))
        tokens: list[list[int]] = [[] for _ in prompts]
        scores: list[list[PromptLogprobs]] = [[] for _ in prompts]
        finished: dict[int, FinishEvent] = {}
        while len(finished) < len(prompts):
            index, event = events.get()
            if isinstance(event, TokenEvent):
                tokens[index].append(event.token.token_id)
            elif isinstance(event, PromptLogprobsEvent):
                scores[index].append(event.scores)
            else:
                finished[index] = event
        outputs = []
        for i, prompt_ids in enumerate(ids):
            detok = IncrementalDetokenizer(self.tokenizer)
            text = detok.push(tokens[i]) + detok.flush()
            prompt_logprobs = None
            if params_list[i].prompt_logprobs is not None:
                prompt_logprobs = PromptLogprobs.join(scores[i]) if scores[i] else PromptLogprobs(-1, 1, (), (), (), ())
            outputs.append(
                CompletionOutput(prompt_ids, tokens[i], text, finished[i].outcome, finished[i].timings, prompt_logprobs)
            )
        return outputs

    def _encode(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return encode_chat(self.tokenizer, [{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def close(self) -> None:
        self.runtime.loop.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
