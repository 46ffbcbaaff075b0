"""The libraries apps use for typed answers, unchanged, against a live server on the real model in both modes: the
openai SDK's `parse`, instructor (TOOLS and JSON_SCHEMA modes), pydantic-ai (tool output and NativeOutput) and
LangChain's `with_structured_output` (json_schema and function_calling). Each answer is the library's own typed
object, and validates against its schema with `jsonschema`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

pytest.importorskip("xgrammar")

from tests.server_harness import RunningServer, mode_config, openai_client, real_loaded_model, running_server

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France? Answer with the city and its country."
MAX_TOKENS = 64


class City(BaseModel):
    city: str
    country: str


SCHEMA = City.model_json_schema()


@pytest.fixture(scope="module", params=["dynamic", "continuous"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with running_server(mode_config(request.param), real_loaded_model()) as running:
        yield running


def _model_id(server: RunningServer) -> str:
    return str(httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"])


def _check(answer: Any) -> None:
    assert isinstance(answer, City), answer
    jsonschema.validate(answer.model_dump(), SCHEMA)
    assert answer.city and answer.country


def test_openai_sdk_parse(server: RunningServer) -> None:
    client = openai_client(server)
    completion = client.chat.completions.parse(
        model=_model_id(server),
        messages=[{"role": "user", "content": QUESTION}],
        response_format=City,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert completion.choices[0].finish_reason == "stop"
    _check(completion.choices[0].message.parsed)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(server: RunningServer, mode: str) -> None:
    import instructor

    client = instructor.from_openai(openai_client(server), mode=getattr(instructor.Mode, mode))
    answer = client.chat.completions.create(
        model=_model_id(server),
        response_model=City,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,  # a first answer that does not validate must fail the test, not be retried
    )
    _check(answer)


@pytest.mark.parametrize("output", ["tool", "native"])
def test_pydantic_ai(server: RunningServer, output: str) -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        _model_id(server), provider=OpenAIProvider(base_url=f"{server.base_url}/v1", api_key="unused")
    )
    output_type: Any = City if output == "tool" else NativeOutput(City)
    agent = Agent(model, output_type=output_type, retries=0)
    settings = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    result = asyncio.run(agent.run(QUESTION, model_settings=settings))  # type: ignore[arg-type]
    _check(result.output)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server: RunningServer, method: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        model=_model_id(server),
        temperature=0,
        max_completion_tokens=MAX_TOKENS,
        max_retries=0,
    )
    _check(chat.with_structured_output(City, method=method).invoke(QUESTION))  # type: ignore[arg-type]
