"""The API with the real SmolLM2-135M-Instruct: greedy answers in both modes equal transformers' `generate()`."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

from engine.weights.loader import LoadedModel
from tests.server_harness import (
    MODES,
    RunningServer,
    as_dicts,
    mode_config,
    openai_client,
    real_loaded_model,
    running_server,
)

pytestmark = pytest.mark.slow

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, there was a")
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return real_loaded_model()


def reference(loaded: LoadedModel, prompt_ids: list[int]) -> tuple[str, int]:
    """transformers' greedy generate() alone: (text, generated token count, EOS included)."""
    with torch.no_grad():
        output = loaded.model.generate(  # type: ignore[operator]
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=list(loaded.eos_token_ids),
            pad_token_id=loaded.eos_token_ids[0],
        )
    new_ids = output[0, len(prompt_ids) :].tolist()
    text = loaded.tokenizer.decode(new_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return str(text), len(new_ids)


@pytest.fixture(scope="module")
def expected(loaded: LoadedModel) -> dict[str, tuple[str, int]]:
    """Reference answers, computed before any server shares the model."""
    answers = {p: reference(loaded, loaded.tokenizer(p)["input_ids"]) for p in PROMPTS}
    chat_ids = loaded.tokenizer.apply_chat_template(
        as_dicts(MESSAGES), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    answers["<chat>"] = reference(loaded, list(chat_ids))  # type: ignore[arg-type]
    return answers


@pytest.fixture(scope="module", params=MODES)
def server(
    request: pytest.FixtureRequest, loaded: LoadedModel, expected: dict[str, tuple[str, int]]
) -> Iterator[RunningServer]:
    with running_server(mode_config(request.param), loaded=loaded) as running:
        yield running


def complete(client: openai.OpenAI, model: str, prompt: str) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)


@pytest.mark.parametrize("mode", MODES)
def test_batched_greedy_completions_equal_transformers_generate(
    mode: str, loaded: LoadedModel, expected: dict[str, tuple[str, int]]
) -> None:
    # Dynamic: the batch leaves exactly when all the prompts wait (its timeout is out of reach). Continuous: they
    # run side by side, joining as they arrive.
    config = mode_config(mode, max_batch_size=len(PROMPTS), batch_timeout_ms=600_000.0, max_num_seqs=len(PROMPTS))
    with running_server(config, loaded=loaded) as server:
        client = openai_client(server)
        model = client.models.list().data[0].id
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrently, so they share batches
            results = list(pool.map(lambda p: complete(client, model, p), PROMPTS))
    for prompt, result in zip(PROMPTS, results, strict=True):
        text, count = expected[prompt]
        choice = result.choices[0]
        assert choice.text == text, prompt
        assert result.usage is not None and result.usage.completion_tokens == count
        assert choice.finish_reason == ("length" if count == MAX_TOKENS else "stop")
        assert result.timings["mode"] == mode  # type: ignore[attr-defined]
    if mode == "dynamic":
        assert len({r.timings["batch_id"] for r in results}) == 1  # type: ignore[attr-defined]


def test_chat_uses_the_models_chat_template(server: RunningServer, expected: dict[str, tuple[str, int]]) -> None:
    client = openai_client(server)
    result = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    text, count = expected["<chat>"]
    assert result.choices[0].message.content == text
    assert "Paris" in text
    assert result.usage is not None and result.usage.completion_tokens == count


def test_streamed_text_concatenates_to_the_non_streamed_text(server: RunningServer) -> None:
    client = openai_client(server)
    model = client.models.list().data[0].id
    whole = complete(client, model, PROMPTS[1]).choices[0].text
    chunks = list(
        client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    chat_whole = (
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .message.content
    )
    chat_chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == chat_whole


def test_tokenize_counts_what_the_endpoints_count_and_detokenize_gives_the_text_back(
    server: RunningServer, loaded: LoadedModel
) -> None:
    """SmolLM2's own template and tokenizer: /tokenize of the messages is the chat answer's prompt_tokens, a
    prompt round-trips, and the model card's root is where the model was loaded from."""
    client = openai_client(server)
    card = client.models.retrieve(client.models.list().data[0].id)
    assert card.model_extra is not None and card.model_extra["root"] == loaded.source
    chat = client.chat.completions.create(model=card.id, messages=MESSAGES, max_tokens=1)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        counted = http.post("/tokenize", json={"messages": as_dicts(MESSAGES)}).json()
        assert chat.usage is not None and counted["count"] == chat.usage.prompt_tokens
        for prompt in PROMPTS:
            tokens = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
            assert tokens == loaded.tokenizer(prompt)["input_ids"]
            assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": prompt}


def test_a_right_prediction_is_accepted_and_changes_no_answer(
    server: RunningServer, expected: dict[str, tuple[str, int]]
) -> None:
    """Predicted Outputs on SmolLM2: `generate()`'s own answer sent as the prediction comes back unchanged, almost
    every token of it accepted as a draft."""
    client = openai_client(server)
    model = client.models.list().data[0].id
    for prompt in PROMPTS:
        text, count = expected[prompt]
        done = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"prediction": {"type": "content", "content": text}},
        )  # fmt: skip
        assert done.choices[0].text == text
        details = done.usage.completion_tokens_details if done.usage else None
        assert details is not None and details.accepted_prediction_tokens is not None
        # Not all: the draft-length rule runs a plain step to measure at a new row count, and each verify step
        # ends on a token of its own; re-encoding the text may differ at the end.
        assert details.accepted_prediction_tokens >= count // 2, (prompt, details)
        assert (details.rejected_prediction_tokens or 0) <= 3, (prompt, details)
