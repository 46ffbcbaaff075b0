"""vLLM's small endpoints on live servers in both modes: `/tokenize` counts what the generation endpoints count,
`/detokenize` gives the text back, `/version` says which optional features are on, and the model card is one
object whether listed or retrieved by id (the openai SDK's `models.list` and `models.retrieve`)."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from api.endpoints import server_info
from api.endpoints.state import ServerState
from api.structured.grammars import INSTALL_HINT
from tests.server_harness import RunningServer, mode_config, running_server, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo 😀 <|eos|> ünïcode"]
CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hello"}]},
    {
        "messages": [
            {"role": "system", "content": "you are terse"},
            {"role": "user", "content": [{"type": "text", "text": "the quick "}, {"type": "text", "text": "fox"}]},
            {"role": "assistant", "content": "jumps"},
            {"role": "developer", "content": "numbers 0123"},
        ]
    },
    {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello wor"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {
        "messages": [{"role": "user", "content": "what is 2+2?"}],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        "tool_choice": "none",  # the tools reach the template and no call is asked for; /tokenize ignores it
    },
]


def _http(server: RunningServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokenize_counts_a_prompt_as_completions_does_and_detokenize_gives_it_back(
    server: RunningServer, client: openai.OpenAI, prompt: str
) -> None:
    with _http(server) as http:
        answer = http.post("/tokenize", json={"prompt": prompt}).json()
        assert set(answer) == {"count", "max_model_len", "tokens"}
        assert answer["tokens"] == tiny_tokenizer()(prompt)["input_ids"]
        assert answer["count"] == len(answer["tokens"])
        assert answer["max_model_len"] == server.runtime.max_model_len
        completion = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=1)
        assert completion.usage is not None and completion.usage.prompt_tokens == answer["count"]
        back = http.post("/detokenize", json={"tokens": answer["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": prompt}


@pytest.mark.parametrize("request_fields", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_tokenize_counts_messages_as_the_chat_endpoint_does(
    server: RunningServer, request_fields: dict[str, Any]
) -> None:
    with _http(server) as http:
        answer = http.post("/tokenize", json=request_fields).json()
        chat = http.post("/v1/chat/completions", json={**request_fields, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert answer["count"] == len(answer["tokens"]) == chat.json()["usage"]["prompt_tokens"]


def test_tokenize_returns_token_strings_and_takes_token_ids_as_they_are(server: RunningServer) -> None:
    tokenizer = tiny_tokenizer()
    with _http(server) as http:
        answer = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
        assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
        ids = [5, 17, 300]
        assert http.post("/tokenize", json={"prompt": ids}).json()["tokens"] == ids  # ids are taken as they are


def test_messages_with_add_special_tokens_count_as_the_chat_endpoint_does(server: RunningServer) -> None:
    """Both answered 500 once: chat_prompt called build_inputs_with_special_tokens, which transformers 5 dropped."""
    fields = {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}
    with _http(server) as http:
        answer = http.post("/tokenize", json=fields)
        chat = http.post("/v1/chat/completions", json={**fields, "max_tokens": 1})
        assert answer.status_code == chat.status_code == 200, (answer.text, chat.text)
        assert answer.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_detokenize_keeps_special_tokens(server: RunningServer) -> None:
    tokenizer = tiny_tokenizer()
    ids = tokenizer("hello")["input_ids"] + [int(tokenizer.eos_token_id)]
    with _http(server) as http:
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hello<|eos|>"}
        assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_models_list_and_retrieve_give_the_same_card(server: RunningServer, client: openai.OpenAI) -> None:
    listed = client.models.list().data
    assert len(listed) == 1
    card = client.models.retrieve(listed[0].id)
    assert card == listed[0]
    assert card.id == "tiny-llama" and card.object == "model" and card.owned_by == "batchserve"
    assert card.created == ServerState.of(server.app).started > 0  # type: ignore[arg-type]
    assert card.model_extra == {"root": server.runtime.source, "parent": None, "max_model_len": 256}


def test_an_unknown_model_id_is_a_404_naming_it(client: openai.OpenAI) -> None:
    for unknown in ("gpt-4", "org/tiny-llama", "tiny-llama/x"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(unknown)
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert f"'{unknown}'" in error["message"]


def test_version_is_the_package_version_with_its_optional_features(server: RunningServer) -> None:
    with _http(server) as http:
        answer = http.get("/version").json()
    assert answer == {
        "version": importlib.metadata.version("batchserve"),
        "features": {"structured_outputs": server.runtime.grammars is not None},
    }


def test_without_xgrammar_the_server_warns_once_and_version_says_structured_outputs_are_off(
    monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "api.structured.xgrammar_backend", None)  # its import now fails
    with running_server(mode_config("continuous")) as srv, _http(srv) as http:
        assert http.get("/version").json()["features"] == {"structured_outputs": False}
        assert http.post("/tokenize", json={"prompt": "hello"}).status_code == 200  # what needs no grammar works
        structured = http.post("/v1/completions", json={"prompt": "hi", "guided_choice": ["a", "b"]})
        assert structured.status_code == 400 and INSTALL_HINT in structured.json()["error"]["message"]
    warnings = [r for r in logs.records if r.levelno == logging.WARNING and "xgrammar is not installed" in r.message]
    assert len(warnings) == 1 and INSTALL_HINT in warnings[0].message


def test_a_source_tree_never_installed_reports_pyprojects_version(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(server_info.importlib.metadata, "version", not_installed)
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    assert server_info.package_version() == pyproject["project"]["version"]
