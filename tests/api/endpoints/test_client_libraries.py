"""The client libraries people already point at vLLM work against batchserve unchanged, in both modes.

Each test drives a live server (uvicorn on a free port) through the real library: the official `openai` SDK,
LangChain's `ChatOpenAI` and `OpenAI`, and the lm-evaluation-harness' `local-completions` model. The libraries
send what they always send (explicit nulls, `tools` with `tool_choice: "none"`, `response_format: {"type":
"text"}`, vLLM's extensions in `extra_body`), and the answers must equal those of the plain request. The
lm-eval scores must equal the same harness' scores with its own `hf` model on the same float32 checkpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from engine.weights.checkpoints import gguf_checkpoint_dir
from engine.weights.loader import LoadedModel, default_model_path
from tests.server_harness import (
    RunningServer,
    as_dicts,
    mode_config,
    openai_client,
    real_loaded_model,
    running_server,
    tiny_loaded_model,
)

MODES = ("dynamic", "continuous")
PROMPT = "the quick brown fox"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world, this is a test"}]
MAX_TOKENS = 8
# vLLM sampling extensions at values that leave a greedy 8-token answer unchanged (the reference ends on length,
# so no EOS comes before min_tokens; top_k is moot at temperature 0; a repetition penalty of 1 is none).
NOOP_EXTRA_BODY = {"top_k": 50, "min_tokens": 4, "repetition_penalty": 1.0}


def _server_for(request: pytest.FixtureRequest, loaded: LoadedModel) -> Iterator[tuple[RunningServer, LoadedModel]]:
    with running_server(mode_config(request.param), loaded) as server:
        yield server, loaded


@pytest.fixture(scope="module", params=MODES)
def tiny(request: pytest.FixtureRequest) -> Iterator[tuple[RunningServer, LoadedModel]]:
    """A tiny-model server in each mode, with the model object it serves."""
    yield from _server_for(request, tiny_loaded_model())


def _model_id(server: RunningServer) -> str:
    return str(httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"])


def _prompt_len(loaded: LoadedModel) -> int:
    return len(loaded.tokenizer(PROMPT)["input_ids"])


def _chat_prompt_len(loaded: LoadedModel, messages: list[ChatCompletionMessageParam]) -> int:
    text = loaded.tokenizer.apply_chat_template(as_dicts(messages), tokenize=False, add_generation_prompt=True)
    return len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def reference(tiny: tuple[RunningServer, LoadedModel]) -> dict[str, Any]:
    """The plain greedy requests' answers (no optional field set), which every variant below must reproduce."""
    server, _ = tiny
    client = openai_client(server)
    model = _model_id(server)
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    # The usage checks below count on 8 generated tokens: a tiny random model does not stop early.
    assert completion.choices[0].finish_reason == "length"
    assert chat.choices[0].finish_reason == "length"
    assert completion.choices[0].text and chat.choices[0].message.content
    return {"model": model, "completion": completion.choices[0].text, "chat": chat.choices[0].message.content}


def _collect_stream(stream: Any, chat: bool) -> tuple[str, str | None, Any]:
    """Text, finish reason and the usage of the closing chunk, which (asked for with include_usage) has no choices."""
    text, finish, usage = "", None, None
    for chunk in stream:
        assert usage is None, "a chunk came after the usage chunk"
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
        if chunk.choices == []:
            usage = chunk.usage
    return text, finish, usage


def _assert_usage(usage: Any, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
    )


# --- the official openai SDK -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_completions_with_explicit_nulls_and_vllm_extras(tiny, reference, stream: bool) -> None:
    server, loaded = tiny
    # The SDK types `user` as a string (no null), but clients send an explicit null: the point of this test.
    reply = openai_client(server).completions.create(  # type: ignore[call-overload]
        model=reference["model"],
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        top_p=None,
        n=None,
        best_of=None,
        presence_penalty=None,
        frequency_penalty=None,
        logit_bias=None,
        logprobs=None,
        echo=None,
        seed=None,
        stop=None,
        suffix=None,
        user=None,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        extra_body=NOOP_EXTRA_BODY,
    )
    if stream:
        text, finish, usage = _collect_stream(reply, chat=False)
    else:
        assert isinstance(reply, Completion)  # not streamed: the whole answer
        text, finish, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
    assert text == reference["completion"]
    assert finish == "length"
    _assert_usage(usage, _prompt_len(loaded), MAX_TOKENS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_completions_null_temperature_is_the_default_and_top_k_is_applied(tiny, reference, stream) -> None:
    """temperature=None is the default (1.0: seeded sampling, not greedy); extra_body's top_k=1 makes it greedy."""
    server, _ = tiny
    client = openai_client(server)

    def text(**fields: Any) -> str:
        reply = client.completions.create(
            model=reference["model"], prompt=PROMPT, max_tokens=MAX_TOKENS, stream=stream, **fields
        )
        return _collect_stream(reply, chat=False)[0] if stream else reply.choices[0].text

    sampled = text(seed=11)
    assert sampled != reference["completion"]
    assert text(temperature=None, seed=11) == sampled
    assert text(temperature=None, extra_body={"top_k": 1}) == reference["completion"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_chat_with_explicit_nulls_noop_tools_and_vllm_extras(tiny, reference, stream: bool) -> None:
    server, loaded = tiny
    weather_tool: ChatCompletionFunctionToolParam = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    # The SDK types `user` as a string (no null), but clients send an explicit null: the point of this test.
    reply = openai_client(server).chat.completions.create(  # type: ignore[call-overload]
        model=reference["model"],
        messages=MESSAGES,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        top_p=None,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        logit_bias=None,
        logprobs=None,
        top_logprobs=None,
        seed=None,
        stop=None,
        user=None,
        tools=[weather_tool],
        tool_choice="none",
        response_format={"type": "text"},
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        extra_body=NOOP_EXTRA_BODY,
    )
    text: str | None  # a message's content is optional
    if stream:
        text, finish, usage = _collect_stream(reply, chat=True)
    else:
        assert isinstance(reply, ChatCompletion)  # not streamed: the whole answer
        message = reply.choices[0].message
        assert not message.tool_calls
        text, finish, usage = message.content, reply.choices[0].finish_reason, reply.usage
    assert text == reference["chat"]
    assert finish == "length"
    _assert_usage(usage, _chat_prompt_len(loaded, MESSAGES), MAX_TOKENS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_chat_null_temperature_is_the_default_and_top_k_is_applied(tiny, reference, stream: bool) -> None:
    server, _ = tiny
    client = openai_client(server)

    def text(**fields: Any) -> str:
        reply = client.chat.completions.create(
            model=reference["model"], messages=MESSAGES, max_tokens=MAX_TOKENS, stream=stream, **fields
        )
        if stream:
            return _collect_stream(reply, chat=True)[0]
        assert isinstance(reply, ChatCompletion)  # not streamed: the whole answer
        return str(reply.choices[0].message.content)

    sampled = text(seed=11)
    assert sampled != reference["chat"]
    assert text(temperature=None, seed=11) == sampled
    assert text(temperature=None, extra_body={"top_k": 1}) == reference["chat"]


def test_openai_completions_echo_scores_the_prompt(tiny, reference) -> None:
    """echo with max_tokens=0 and logprobs: the prompt's own logprobs (the first null), as the model computes them."""
    server, loaded = tiny
    reply = openai_client(server).completions.create(
        model=reference["model"], prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = reply.choices[0]
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids])).logits[0].float()
    expected = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert choice.text == PROMPT
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None and reply.usage is not None
    assert choice.logprobs.tokens == [loaded.tokenizer.decode([i]) for i in ids]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == 0


# --- LangChain -------------------------------------------------------------------------------------------------


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def _chat_model(server: RunningServer, model: str, **kwargs: Any) -> ChatOpenAI:
    # pydantic turns the str into a SecretStr; langchain annotates the field with the converted type only
    return ChatOpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        model=model,
        max_retries=0,
        **kwargs,
    )


def _add_chunks(chunks: list[Any]) -> Any:
    assert len(chunks) > 1
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total


def _run_chat(chat: Any, stream: bool) -> Any:
    """The whole AIMessage from invoke, or the chunks of stream added up into one message."""
    prompt = MESSAGES[0]["content"]
    return _add_chunks(list(chat.stream(prompt))) if stream else chat.invoke(prompt)


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_chat_openai(tiny, reference, stream: bool) -> None:
    server, loaded = tiny
    chat = _chat_model(server, reference["model"], temperature=0, max_tokens=MAX_TOKENS, stream_usage=True)
    message = _run_chat(chat, stream)
    assert message.content == reference["chat"]
    assert message.usage_metadata["input_tokens"] == _chat_prompt_len(loaded, MESSAGES)
    assert message.usage_metadata["output_tokens"] == MAX_TOKENS
    assert message.response_metadata["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_chat_openai_bind_tools_with_tool_choice_none(tiny, reference, stream: bool) -> None:
    server, _ = tiny
    chat = _chat_model(server, reference["model"], temperature=0, max_tokens=MAX_TOKENS)
    message = _run_chat(chat.bind_tools([get_weather], tool_choice="none"), stream)
    assert message.content == reference["chat"]
    assert message.tool_calls == []


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_chat_openai_vllm_extra_body(tiny, reference, stream: bool) -> None:
    """vLLM's documented LangChain usage: sampling extensions in extra_body; temperature left unset (null)."""
    server, _ = tiny
    chat = _chat_model(server, reference["model"], max_tokens=MAX_TOKENS, extra_body={**NOOP_EXTRA_BODY, "top_k": 1})
    assert _run_chat(chat, stream).content == reference["chat"]


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_openai_completions_llm(tiny, reference, stream: bool) -> None:
    server, _ = tiny
    llm = OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",  # type: ignore[arg-type]  # pydantic makes it a SecretStr (the field's annotated type)
        model=reference["model"],
        max_retries=0,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    text = "".join(llm.stream(PROMPT)) if stream else llm.invoke(PROMPT)
    assert text == reference["completion"]


# --- on the real model: LangChain's response_format path, and lm-eval against transformers ---------------------


def real_checkpoint_dir() -> Path:
    """The float32 safetensors checkpoint (with its tokenizer) the loader converted the default GGUF into."""
    real_loaded_model()  # converts and fills the cache on a miss
    directory = gguf_checkpoint_dir(default_model_path())
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    return directory


@pytest.fixture(scope="module", params=MODES)
def real(request: pytest.FixtureRequest) -> Iterator[tuple[RunningServer, LoadedModel]]:
    yield from _server_for(request, real_loaded_model())


SHORT_ANSWER = "What is the capital of France? Answer with one word."  # SmolLM2 answers in a sentence, then stops


@pytest.fixture(scope="module")
def real_short_answer(real: tuple[RunningServer, LoadedModel]) -> str:
    server, _ = real
    reply = openai_client(server).chat.completions.create(
        model=_model_id(server), messages=[{"role": "user", "content": SHORT_ANSWER}], max_tokens=32, temperature=0
    )
    assert reply.choices[0].finish_reason == "stop"
    return str(reply.choices[0].message.content)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_chat_openai_response_format_text(real, real_short_answer, stream: bool) -> None:
    """With response_format LangChain goes through the SDK's parse()/stream() helpers, which need a natural stop."""
    server, _ = real
    chat = _chat_model(server, _model_id(server), temperature=0, max_tokens=32)
    bound = chat.bind(response_format={"type": "text"})
    message = bound.invoke(SHORT_ANSWER) if not stream else _add_chunks(list(bound.stream(SHORT_ANSWER)))
    assert message.content == real_short_answer
    assert message.response_metadata["finish_reason"] == "stop"


# Small tasks from local data only: a multiple-choice task and a loglikelihood task (each scored from the prompt's
# logprobs: echo + logprobs), and a generate_until task (greedy, stop at a newline).
_MC = [
    ("What is the capital of France?", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("What color is the sky on a clear day?", [" green", " blue", " red", " yellow"], 1),
    ("How many legs does a spider have?", [" six", " four", " eight", " ten"], 2),
    ("Which animal is known as the king of the jungle?", [" the mouse", " the cow", " the lion", " the fish"], 2),
    ("What do bees make?", [" honey", " milk", " silk", " glass"], 0),
    ("Which planet do we live on?", [" Mars", " Venus", " Jupiter", " Earth"], 3),
    ("What is frozen water called?", [" steam", " ice", " sand", " oil"], 1),
    ("How many days are in a week?", [" seven", " five", " nine", " three"], 0),
    ("Which season is the coldest?", [" summer", " spring", " winter", " autumn"], 2),
    ("What do you use to write on paper?", [" a spoon", " a pen", " a shoe", " a cup"], 1),
]
_LL = [  # the continuation, with its leading space; some are the model's greedy choice and some not
    ("The capital of France is", " Paris"),
    ("1, 2, 3, 4, 5,", " 6"),
    ("a, b, c, d, e,", " f"),
    ("Monday, Tuesday,", " Wednesday"),
    ("The opposite of black is", " white"),
    ("The sun rises in the", " east"),
    ("Cats say meow and dogs say", " woof"),
    ("Happy birthday to", " you"),
]
_GEN = [
    ("What is the capital of France?", "Paris"),
    ("What is 2 plus 2?", "4"),
    ("What color is grass?", "green"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("How many days are in a week?", "7"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the opposite of up?", "down"),
    ("What is the capital of Italy?", "Rome"),
]
TASKS = ["bs_mc", "bs_ll", "bs_gen"]


def _write_tasks(root: Path) -> Path:
    """Task YAMLs (JSON is YAML) over JSONL files; the datasets cache stays under `root` too."""
    data: dict[str, list[dict[str, Any]]] = {  # rows of each task's JSONL file
        "bs_mc": [{"question": q, "choices": c, "answer": a} for q, c, a in _MC],
        "bs_ll": [{"context": c, "answer": a} for c, a in _LL],
        "bs_gen": [{"question": q, "answer": a} for q, a in _GEN],
    }
    tasks: dict[str, dict[str, Any]] = {  # lm-eval task configs, as JSON
        "bs_mc": {
            "output_type": "multiple_choice",
            "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "target_delimiter": "",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
        },
        "bs_ll": {
            "output_type": "loglikelihood",
            "doc_to_text": "{{context}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}, {"metric": "perplexity"}],
        },
        "bs_gen": {
            "output_type": "generate_until",
            "description": "Answer with one word.\n\nQ: What is the capital of Germany?\nA: Berlin\n\n"
            "Q: What color is snow?\nA: white\n\n",
            "doc_to_text": "Q: {{question}}\nA:",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 16, "do_sample": False, "temperature": 0},
            "filter_list": [
                {"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}
            ],
            "metric_list": [{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}],
        },
    }
    task_dir = root / "tasks"
    task_dir.mkdir(parents=True)
    for name, config in tasks.items():
        data_file = root / f"{name}.jsonl"
        data_file.write_text("".join(json.dumps(row) + "\n" for row in data[name]))
        dataset = {"data_files": {"test": str(data_file)}, "cache_dir": str(root / "datasets")}
        full: dict[str, Any] = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": dataset,
            "test_split": "test",
            **config,
        }
        for metric in full["metric_list"]:
            metric.setdefault("aggregation", "perplexity" if metric["metric"] == "perplexity" else "mean")
            metric.setdefault("higher_is_better", metric["metric"] != "perplexity")
        (task_dir / f"{name}.yaml").write_text(json.dumps(full, indent=1))
    return task_dir


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tasks(tmp_path_factory.mktemp("lm_eval"))


def _evaluate(task_dir: Path, model: str, model_args: dict[str, Any], batch_size: int = 1) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        batch_size=batch_size,
        bootstrap_iters=0,
        log_samples=True,
    )
    assert results is not None
    return results


@pytest.fixture(scope="module")
def hf_scores(lm_eval_tasks: Path) -> dict[str, Any]:
    """The harness' own transformers model on the same float32 checkpoint: the reference."""
    return _evaluate(
        lm_eval_tasks, "hf", {"pretrained": str(real_checkpoint_dir()), "dtype": "float32", "device": "cpu"}
    )


@pytest.fixture(scope="module")
def server_scores(real, lm_eval_tasks: Path) -> dict[str, Any]:
    """lm-eval's `local-completions` model on the live server: token-id prompts, 4 per request, 2 requests at once."""
    server, _ = real
    model_args = {
        "model": _model_id(server),
        "base_url": f"{server.base_url}/v1/completions",
        "tokenizer": str(real_checkpoint_dir()),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": 2,
        "max_retries": 1,
    }
    return _evaluate(lm_eval_tasks, "local-completions", model_args, batch_size=4)


def _samples(scores: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(scores["samples"][task], key=lambda s: s["doc_id"])


def _metrics(scores: dict[str, Any], task: str) -> dict[str, float]:
    return {k: v for k, v in scores["results"][task].items() if isinstance(v, float) and "stderr" not in k}


def _assert_loglikelihoods_match(server_scores: dict[str, Any], hf_scores: dict[str, Any], task: str) -> None:
    served, reference = _samples(server_scores, task), _samples(hf_scores, task)
    assert [s["doc_id"] for s in served] == [s["doc_id"] for s in reference]
    for ours, theirs in zip(served, reference, strict=True):
        ours_ll = [ll for ll, _ in ours["filtered_resps"]]
        theirs_ll = [ll for ll, _ in theirs["filtered_resps"]]
        assert ours_ll == pytest.approx(theirs_ll, abs=2e-3), ours["doc_id"]
        assert [g for _, g in ours["filtered_resps"]] == [g for _, g in theirs["filtered_resps"]], ours["doc_id"]


@pytest.mark.slow
def test_lm_eval_multiple_choice_scores_equal_hf(server_scores, hf_scores) -> None:
    _assert_loglikelihoods_match(server_scores, hf_scores, "bs_mc")
    assert _metrics(server_scores, "bs_mc") == _metrics(hf_scores, "bs_mc")
    assert _metrics(hf_scores, "bs_mc")["acc,none"] > 0.5  # the task discriminates: not a tie at chance


@pytest.mark.slow
def test_lm_eval_loglikelihood_scores_equal_hf(server_scores, hf_scores) -> None:
    _assert_loglikelihoods_match(server_scores, hf_scores, "bs_ll")
    ours, theirs = _metrics(server_scores, "bs_ll"), _metrics(hf_scores, "bs_ll")
    assert ours["acc,none"] == theirs["acc,none"]  # greedy or not, per token: the top-logprob check
    assert 0 < theirs["acc,none"] < 1
    assert math.isclose(ours["perplexity,none"], theirs["perplexity,none"], rel_tol=1e-3)


@pytest.mark.slow
def test_lm_eval_generate_until_scores_equal_hf(server_scores, hf_scores) -> None:
    served = [s["filtered_resps"] for s in _samples(server_scores, "bs_gen")]
    reference = [s["filtered_resps"] for s in _samples(hf_scores, "bs_gen")]
    assert served == reference
    assert _metrics(server_scores, "bs_gen") == _metrics(hf_scores, "bs_gen")
    assert _metrics(hf_scores, "bs_gen")["exact_match,strip"] > 0.5
