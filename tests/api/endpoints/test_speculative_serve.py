"""`serve --speculative-config` end to end on the tiny model: greedy completions, streamed or not, with a stop string
or not, are the same text and usage with n-gram speculation on as off."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server_harness import mode_config, openai_client, running_server

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPTS = ("the cat sat on the mat, the cat sat on the mat, the cat", "hello world", "abc abc abc abc abc")


def completions(server: Any, **extra: Any) -> list[tuple[str, int, str | None]]:
    client = openai_client(server)
    answers = []
    for prompt in PROMPTS:
        done = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0, **extra)
        assert done.usage is not None
        answers.append((done.choices[0].text, done.usage.completion_tokens, done.choices[0].finish_reason))
    return answers


def streamed(server: Any) -> list[str]:
    client = openai_client(server)
    texts = []
    for prompt in PROMPTS:
        chunks = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=20, temperature=0, stream=True)
        texts.append("".join(c.choices[0].text for c in chunks if c.choices))
    return texts


def test_speculation_changes_no_answer(one_torch_thread: None) -> None:
    with (
        running_server(mode_config("continuous")) as plain,
        running_server(mode_config("continuous", speculative_config=SPEC)) as spec,
    ):
        reference = completions(plain)
        assert completions(spec) == reference
        assert streamed(spec) == streamed(plain)
        stop = reference[0][0][3:5]  # a stop string that occurs early in the first answer
        assert completions(spec, stop=[stop]) == completions(plain, stop=[stop])
        drafted, accepted = counter(spec, "draft"), counter(spec, "accepted")
        assert 0 < accepted <= drafted
        assert counter(plain, "draft") == 0


def counter(server: Any, which: str) -> float:
    """The server's vllm:spec_decode_num_{which}_tokens counter (0 before anything was drafted)."""
    text = httpx.get(f"{server.base_url}/metrics").text
    name = f"vllm:spec_decode_num_{which}_tokens_total"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))
