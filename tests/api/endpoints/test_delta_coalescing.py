"""Tokens already queued when the stream gets to them go out as one delta per choice (vLLM's output collector does
the same): a speculative step's several tokens, or steps that ran while a slow client was written to. Driven on the
real scheduler over the tiny model, stepped by hand so that every token is queued before the stream reads: the
merged delta must hold every token's text and logprob in order, and a choice's end stays a delta of its own."""

from __future__ import annotations

import asyncio

from api.config import ServerConfig
from api.endpoints.metrics import ServerMetrics
from api.endpoints.service import GenerationService
from api.protocol.deltas import ChoiceDelta, ChoiceInput, TokenLogprob
from api.runtime.build import build_model_runtime
from engine.sample.sampling_params import SamplingParams
from tests.server_harness import tiny_loaded_model, tiny_tokenizer

PROMPT = "the quick brown fox"


def run_queued(max_tokens: int, choices: int, logprobs: int | None) -> tuple[list[ChoiceDelta], list[list[int]]]:
    """Every step of a request run before its stream is read; (the stream's deltas, each choice's token ids)."""
    loaded = tiny_loaded_model()
    runtime = build_model_runtime(ServerConfig(mode="continuous").runtime_options(), loaded)
    tokenizer = tiny_tokenizer()
    service = GenerationService(runtime.loop, tokenizer, ServerMetrics("continuous", "tiny-llama"))
    prompt = tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)

    async def run() -> list[ChoiceDelta]:
        generation = service.start([ChoiceInput(list(prompt), params) for _ in range(choices)], "coalesce")
        while runtime.scheduler.step() is not None:  # the whole answer, before the stream reads anything
            pass
        return [delta async for delta in generation.deltas()]

    deltas = asyncio.run(run())
    ids = [[entry.token_id for d in deltas if d.index == i for entry in d.logprobs] for i in range(choices)]
    return deltas, ids


def test_queued_tokens_go_out_as_one_delta_with_every_token() -> None:
    deltas, ids = run_queued(max_tokens=12, choices=1, logprobs=2)
    tokens, end = deltas[:-1], deltas[-1]
    assert len(tokens) == 1  # twelve queued tokens, one chunk
    assert end.finish_reason == "length" and end.timings is not None  # the end is its own delta
    assert tokens[0].num_output_tokens == 12 == len(ids[0])
    assert all(isinstance(entry, TokenLogprob) and len(entry.top) == 2 for entry in tokens[0].logprobs)
    text = tiny_tokenizer().decode(ids[0], skip_special_tokens=True)
    assert tokens[0].text + end.text == text


def test_each_choice_keeps_its_own_text() -> None:
    deltas, ids = run_queued(max_tokens=8, choices=3, logprobs=0)
    for index in range(3):
        mine = [d for d in deltas if d.index == index]
        assert [d.finish_reason for d in mine][-1] == "length"
        assert sum(len(d.logprobs) for d in mine) == 8 == len(ids[index])
        text = "".join(d.text for d in mine)
        assert text == tiny_tokenizer().decode(ids[index], skip_special_tokens=True)
    # The choices' events interleave step by step; each choice's are still merged: its text, then its end.
    assert [d.index for d in deltas if d.finish_reason is None] == [0, 1, 2]
