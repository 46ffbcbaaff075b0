"""`serve --speculative-config` end to end on the tiny model: greedy completions, streamed or not, with a stop string
or not, are the same text and usage with n-gram speculation on as off; drafts and acceptances are counted in each
response's `timings`, vLLM's counters and the event stream's steps alike."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.server_harness import events_read, mode_config, openai_client, running_server

SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
    '"draft_length": "fixed"}'
)
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


def _metric(text: str, name: str) -> dict[str, float]:
    """Each sample of `name` by its label set (as written)."""
    return {
        line.split(" ")[0][len(name) :]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_drafts_and_acceptances_are_counted_per_response_metric_and_step(one_torch_thread: None, mode: str) -> None:
    """`timings` (non-stream and the final stream chunk), the vLLM counters and the event stream's steps all tell
    the same draft and accepted totals."""
    with (
        running_server(mode_config(mode, speculative_config=SPEC, batch_window_ms=1.0)) as server,
        events_read(f"{server.base_url}/v1/events") as events,
    ):
        deadline = time.monotonic() + 60
        while not any(kind == "hello" for kind, _ in events):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
        whole = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        streamed_body = {**body, "prompt": PROMPTS[2], "stream": True, "temperature": 0.8, "seed": 5}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=streamed_body, timeout=60) as reply:
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        final = [c["timings"] for c in chunks if c.get("timings")]
        assert len(final) == 1 and chunks[-1].get("timings") == final[0]  # only the final chunk carries them
        timings = [whole["timings"], final[0]]
        for t in timings:
            assert 0 <= t["accepted_tokens"] <= t["draft_tokens"]
        assert timings[0]["draft_tokens"] > 0 and timings[0]["accepted_tokens"] > 0  # the repetitive prompt
        ids = {whole["id"] + "-0", chunks[0]["id"] + "-0"}
        while not ids <= {e["request_id"] for k, e in events if k == "request" and e["event"] == "released"}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        metrics = httpx.get(f"{server.base_url}/metrics").text
    steps = [e for k, e in events if k == "step"]
    drafted = sum(t["draft_tokens"] for t in timings)
    accepted = sum(t["accepted_tokens"] for t in timings)
    assert sum(s["drafted"] for s in steps) == drafted == counter_of(metrics, "draft")
    assert sum(s["accepted"] for s in steps) == accepted == counter_of(metrics, "accepted")
    drafts = sum(_metric(metrics, "vllm:spec_decode_num_drafts_total").values())
    assert 0 < drafts <= sum(1 for s in steps if s["drafted"]) * 2  # at most one draft per sequence and step
    per_pos = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    by_position = [next(v for k, v in per_pos.items() if f'position="{i}"' in k) for i in range(len(per_pos))]
    assert sum(by_position) == accepted and by_position == sorted(by_position, reverse=True)  # a prefix each time
    assert by_position[0] <= drafts


def counter_of(metrics: str, which: str) -> float:
    return sum(_metric(metrics, f"vllm:spec_decode_num_{which}_tokens_total").values())
