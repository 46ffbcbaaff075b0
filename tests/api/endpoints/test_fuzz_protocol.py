"""Property tests of the protocol edge: request parsing never fails any other way than a named 400, and the SSE
framing of the server's chunks round-trips arbitrary text."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from api.config import ServerConfig
from api.endpoints.formatting import ChatFormatter, CompletionFormatter, ResponseFormatter
from api.endpoints.tokenization import detokenize, tokenize
from api.endpoints.tool_call_formatting import ToolCallFormatter
from api.protocol.deltas import TokenLogprob
from api.protocol.errors import APIError
from api.protocol.messages_api import CountTokensRequest, MessagesRequest, parse_messages_request
from api.protocol.openai_api import (
    INT64_MAX,
    MAX_ID,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_json_text,
    parse_request,
)
from api.protocol.prediction import prediction_token_ids
from api.protocol.responses_api import ResponsesRequest, responses_refusal
from api.structured.budget import budget_problem
from api.structured.limits import GrammarLimits
from api.structured.requests import request_grammar
from api.structured.spec import GrammarCompileError
from api.structured.tools import ToolCallMode
from api.text.chat_template import control_token_texts
from api.text.prompts import chat_prompt
from api.translation.messages import refuse_control_text, to_chat
from api.translation.messages_stream import StreamStart, message_events
from api.translation.responses_input import chat_plan
from tests.server_harness import tiny_tokenizer

pytestmark = pytest.mark.slow

MODELS: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest]
try:
    from api.structured.xgrammar_backend import XGrammarCompiler

    _COMPILER: XGrammarCompiler | None = XGrammarCompiler.for_tokenizer(
        tiny_tokenizer(), len(tiny_tokenizer()), (int(tiny_tokenizer().eos_token_id),)
    )
except ImportError:
    _COMPILER = None
_PREDICTION_CONTEXT = 16  # small, so that drawn texts pass the bound too
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2, 5, 6, 2**31, 2**63, 2**64])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]) | _json,
        "content": st.text(max_size=20)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url"]) | _json}, optional={"text": st.text() | _json}
            ),
            max_size=2,
        )
        | _json,
        "name": _json,
    },
)
# Plausible JSON schemas, so that the walk and the compiler see real keywords, not only noise.
_schema = st.recursive(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "x"]),
            "format": st.sampled_from(["date", "email", "uuid", "password"]),
            "enum": st.lists(_scalars, max_size=3),
            "minimum": _scalars,
            "maxLength": _scalars,
            "pattern": st.text(max_size=6),
            "uniqueItems": st.booleans(),
            "$ref": st.sampled_from(["#/$defs/a", "#/nowhere", "#"]),
        },
    ),
    lambda inner: st.fixed_dictionaries(
        {},
        optional={
            "type": st.just("object"),
            "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
            "required": st.lists(st.text(max_size=4), max_size=2),
            "items": inner,
            "anyOf": st.lists(inner, max_size=2),
            "$defs": st.fixed_dictionaries({"a": inner}),
            "additionalProperties": st.booleans() | inner,
        },
    ),
    max_leaves=8,
)
# Schemas as JSON text, as vLLM takes them: plausible ones, noise, and text past the body's own limits (nesting
# thousands deep, integers of thousands of digits), which Python's json module raised on (RecursionError: a 500).
_deep = st.integers(1, 6_000).flatmap(
    lambda n: st.sampled_from(["[" * n + "]" * n, '{"items":' * n + "{}" + "}" * n, '{"a":[' * n + "1" + "]}" * n])
)
_long_number = st.integers(4_000, 6_000).flatmap(
    lambda n: st.sampled_from(["1" * n, '{"type": "integer", "maximum": ' + "9" * n + "}", "-0." + "5" * n])
)
_json_text = _schema.map(json.dumps) | _json.map(json.dumps) | _deep | _long_number | st.text(max_size=20)
_tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "x"])},
    optional={
        "function": st.fixed_dictionaries(
            {}, optional={"name": st.sampled_from(["f", "g", ""]), "parameters": _schema | _json}
        )
    },
)
_named_choice = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({}, optional={"name": st.sampled_from(["f", "g"])})}
)
_prompt = (
    st.text(max_size=30)
    | st.lists(st.integers(-5, 2**40), max_size=5)
    | st.lists(st.lists(st.integers(-5, 400), max_size=3), max_size=3)
    | st.lists(st.text(max_size=5), max_size=3)
    | _json
)
_FIELD_VALUES = {
    "model": _json,
    "prompt": _prompt,
    "messages": st.lists(_message, max_size=3) | _json,
    "max_tokens": _json,
    "max_completion_tokens": _json,
    "temperature": _json,
    "top_p": _json,
    "top_k": _json,
    "seed": _json,
    "n": _json,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6) | _json,
    "stop_token_ids": st.lists(st.integers(-3, 2**64), max_size=3) | _json,
    "presence_penalty": _json,
    "frequency_penalty": _json,
    "logprobs": _json,
    "top_logprobs": _json,
    "echo": _json,
    "stream": _json,
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": _json, "continuous_usage_stats": _json, "x": _json}
    )
    | _json,
    "ignore_eos": _json,
    "best_of": _json,
    "tools": st.lists(_tool, max_size=2) | _json,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | _named_choice | _json,
    "response_format": st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["text", "json_object", "json_schema"]) | _json,
            "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": _schema | _json_text}) | _json,
        },
    )
    | _json,
    "structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "xml"]),
        _schema | _json | _json_text,
        max_size=2,
    )
    | _json,
    "guided_json": _schema | _json | _json_text,
    "guided_regex": st.text(max_size=12) | _json,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | _json,
    "guided_grammar": st.text(max_size=20) | _json,
    "user": _json,
    "unknown": _json,
    "min_tokens": _json,
    "min_p": _json,
    "repetition_penalty": _json,
    "logit_bias": st.dictionaries(st.text(max_size=6) | st.integers(0, 400).map(str), _json, max_size=3) | _json,
    "allowed_token_ids": st.lists(st.integers(-3, 2**64), max_size=3) | _json,
    "prompt_logprobs": _json,
    "truncate_prompt_tokens": _json,
    "skip_special_tokens": _json,
    "include_stop_str_in_output": _json,
    "add_generation_prompt": _json,
    "continue_final_message": _json,
    "chat_template_kwargs": _json,
    "request_id": _json,
    "priority": _json,
    "suffix": _json,
    "prediction": st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["content", "text"]) | _json,
            "content": st.text(max_size=20)
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]) | _json}, optional={"text": st.text() | _json}
                ),
                max_size=2,
            )
            | _json,
        },
    )
    | _json,
}
_BASES: dict[type[BaseModel], dict[str, object]] = {
    CompletionRequest: {"prompt": "hello"},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "hello"}]},
}
# /tokenize and /detokenize: their fields, and what they pass on to the prompt and chat paths.
_TOKEN_FIELD_VALUES = {
    "prompt": _prompt,
    "messages": st.lists(_message, max_size=3) | _json,
    "add_special_tokens": _json,
    "add_generation_prompt": _json,
    "continue_final_message": _json,
    "chat_template": _json,
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["tokenize", "x", ""]), _json, max_size=2) | _json,
    "tools": st.lists(_tool, max_size=2) | _json,
    "return_token_strs": _json,
    "tokens": st.lists(st.integers(-3, 2**40) | st.integers(0, 400), max_size=6) | _json,
    "model": _json,
    "unknown": _json,
}
_TOKEN_BASES: dict[type[BaseModel], list[dict[str, object]]] = {
    TokenizeRequest: [{"prompt": "hello"}, {"messages": [{"role": "user", "content": "hello"}]}],
    DetokenizeRequest: [{"tokens": [5, 6]}],
}


def _bodies(model: type[BaseModel]) -> st.SearchStrategy[bytes]:
    """A valid request with one or two fields replaced (so validation goes deep), objects of random known
    fields, any JSON, and bytes that are mostly not JSON."""
    overlay = st.lists(st.sampled_from(sorted(_FIELD_VALUES)), min_size=1, max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: _FIELD_VALUES[k] for k in keys})
    )
    return st.one_of(
        overlay.map(lambda fields: json.dumps({**_BASES[model], **fields}).encode()),
        st.fixed_dictionaries({}, optional=_FIELD_VALUES).map(lambda d: json.dumps(d).encode()),
        _json.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
    )


def _assert_storable(request: BaseModel) -> None:
    """What parses can be handed on: finite floats, integers the engine's int64 rows can hold."""
    for name in type(request).model_fields:  # unknown fields are ignored, never handed on
        value = getattr(request, name)
        if isinstance(value, float):
            assert math.isfinite(value), name
        elif isinstance(value, int) and not isinstance(value, bool):
            assert abs(value) <= INT64_MAX, name
    # A chat request's "prompt" is an unknown field: kept aside by extra="allow", never handed on.
    prompt = request.prompt if "prompt" in type(request).model_fields else None  # type: ignore[attr-defined]
    ids_fields = (prompt, request.stop_token_ids, request.allowed_token_ids)  # type: ignore[attr-defined]
    for ids in ids_fields:
        if isinstance(ids, list):
            flat = [i for item in ids for i in (item if isinstance(item, list) else [item])]
            assert all(0 <= i <= MAX_ID for i in flat if isinstance(i, int))


def _loads_or_none(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@FUZZ
@given(data=st.data())
def test_any_body_parses_or_is_a_named_400(model: type[BaseModel], data: st.DataObject) -> None:
    body = data.draw(_bodies(model), label="body")
    try:
        request = parse_request(model, body)
    except APIError as exc:
        assert exc.status == 400
        assert exc.message and (exc.param is None or f"'{exc.param}" in exc.message)  # names what is wrong
        if isinstance(_loads_or_none(body), dict):
            assert exc.param is not None  # a JSON object's problem is always one of its fields
        assert "Traceback" not in exc.message
        json.dumps(exc.body())  # the error body is serialisable
    else:
        assert isinstance(request, model)
        _assert_storable(request)
        for bias in (request.logit_bias or {}).values():  # type: ignore[attr-defined]
            assert math.isfinite(bias) and -100 <= bias <= 100
        _assert_grammar_or_named_400(request)
        _assert_prediction_or_named_400(request)


def _assert_prediction_or_named_400(request: BaseModel) -> None:
    """Past parsing, a `prediction` gives token ids within the context, or a 400 naming `prediction.*`."""
    try:
        ids = prediction_token_ids(request, tiny_tokenizer(), _PREDICTION_CONTEXT)  # type: ignore[arg-type]
    except APIError as exc:
        assert exc.status == 400 and exc.param is not None and exc.param.startswith("prediction")
        assert "Traceback" not in exc.message
        return
    assert len(ids) <= _PREDICTION_CONTEXT and all(isinstance(i, int) for i in ids)


def _assert_grammar_or_named_400(request: BaseModel) -> None:
    """Past parsing, the structured-output fields give a grammar that compiles, or a 400 naming a field: never
    another exception (the compiler is the one the server builds, over the tiny tokenizer)."""
    try:
        spec = request_grammar(request).spec  # type: ignore[arg-type]
    except APIError as exc:
        assert exc.status == 400 and exc.param is not None and "Traceback" not in exc.message
        return
    if spec is not None and budget_problem(spec, GrammarLimits()) is None and _COMPILER is not None:
        try:
            _COMPILER.compile(spec)
        except GrammarCompileError as exc:
            assert str(exc)


def _field_overlay(values: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """One to three of the fields in `values`, each with a value drawn from its strategy."""
    return st.lists(st.sampled_from(sorted(values)), min_size=1, max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: values[k] for k in keys})
    )


def _token_bodies(model: type[BaseModel]) -> st.SearchStrategy[bytes]:
    overlay = _field_overlay(_TOKEN_FIELD_VALUES)
    base = st.sampled_from(_TOKEN_BASES[model])
    return st.one_of(
        st.tuples(base, overlay).map(lambda pair: json.dumps({**pair[0], **pair[1]}).encode()),
        overlay.map(lambda fields: json.dumps(fields).encode()),
        _json.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    )


@pytest.mark.parametrize("model", [TokenizeRequest, DetokenizeRequest], ids=lambda m: m.__name__)
@FUZZ
@given(data=st.data())
def test_any_tokenize_or_detokenize_body_answers_or_is_a_named_400(
    model: type[TokenizeRequest | DetokenizeRequest], data: st.DataObject
) -> None:
    """Parsing and the answer both (the chat template and the tokenizer run on what parsed): a dict shaped as
    vLLM's, or a 400 naming a field."""
    tokenizer = tiny_tokenizer()
    body = data.draw(_token_bodies(model), label="body")
    try:
        request = parse_request(model, body)
        if isinstance(request, TokenizeRequest):
            answer = tokenize(request, tokenizer, ServerConfig(), 256)
        else:
            answer = detokenize(request, tokenizer)
    except APIError as exc:
        assert exc.status == 400
        # Past parsing the prompt and chat paths word their own messages ("a prompt is empty"): each still says
        # which field, and names it in `param`.
        assert exc.message and (exc.param is None or exc.param in exc.message)
        if isinstance(_loads_or_none(body), dict):
            assert exc.param is not None  # a JSON object's problem is always one of its fields
        json.dumps(exc.body())
        return
    json.dumps(answer)
    if isinstance(request, TokenizeRequest):
        tokens = answer["tokens"]
        assert isinstance(tokens, list) and answer["count"] == len(tokens) and answer["max_model_len"] == 256
        assert all(0 <= t < len(tokenizer) for t in tokens)
    else:
        assert set(answer) == {"prompt"} and isinstance(answer["prompt"], str)


# ----- the Messages API: its bodies onto the chat path -----
_block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking", ""]) | _json},
    optional={
        "text": st.text(max_size=8) | _json,
        "id": st.sampled_from(["toolu_1", "toolu_2", "", "<|eos|>"]) | _json,
        "name": st.sampled_from(["f", "g", "", "f<|eos|>"]) | _json,
        "input": st.dictionaries(st.text(max_size=4), _json, max_size=2) | _json,
        "tool_use_id": st.sampled_from(["toolu_1", "toolu_2", "x"]) | _json,
        "content": st.text(max_size=8)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=4)}), max_size=2)
        | _json,
        "is_error": _json,
        "cache_control": _json,
    },
)
_turn = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "tool", ""]) | _json,
        "content": st.text(max_size=12) | st.lists(_block, max_size=3) | _json,
    },
)
_anthropic_tool = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["f", "g", "", "f<|eos|>"]) | _json,
        "description": st.text(max_size=8) | _json,
        "input_schema": _schema | _json,
        "type": st.sampled_from(["custom", "bash_20250124"]) | _json,
    },
)
_MESSAGES_FIELD_VALUES = {
    "model": _json,
    "max_tokens": _json,
    "messages": st.lists(_turn, max_size=4) | _json,
    "system": st.text(max_size=8) | st.lists(_block, max_size=2) | _json,
    "tools": st.lists(_anthropic_tool, max_size=2) | _json,
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "x"]) | _json},
        optional={"name": st.sampled_from(["f", "g"]) | _json, "disable_parallel_tool_use": _json},
    )
    | _json,
    "stop_sequences": st.lists(st.text(max_size=5), max_size=6) | _json,
    "stream": _json,
    "temperature": _json,
    "top_p": _json,
    "top_k": _json,
    "metadata": st.fixed_dictionaries({}, optional={"user_id": _json}) | _json,
    "output_config": st.fixed_dictionaries(
        {}, optional={"format": st.fixed_dictionaries({"type": st.just("json_schema"), "schema": _schema | _json})}
    )
    | _json,
    "unknown": _json,
}
_MESSAGES_BASE = {"model": "tiny-llama", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}


def _messages_bodies() -> st.SearchStrategy[bytes]:
    overlay = _field_overlay(_MESSAGES_FIELD_VALUES)
    return st.one_of(
        overlay.map(lambda fields: json.dumps({**_MESSAGES_BASE, **fields}).encode()),
        st.fixed_dictionaries({}, optional=_MESSAGES_FIELD_VALUES).map(lambda d: json.dumps(d).encode()),
        _json.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    )


@pytest.mark.parametrize("model", [MessagesRequest, CountTokensRequest], ids=lambda m: m.__name__)
@FUZZ
@given(data=st.data())
def test_any_messages_body_reaches_the_chat_path_or_is_a_named_400(
    model: type[CountTokensRequest], data: st.DataObject
) -> None:
    """Parsing, the translation, its control-text check, the chat rendering and the grammar: a rendered prompt, or
    a 400 whose message names the field (it starts with the field's path, or names `param`), never another error."""
    tokenizer = tiny_tokenizer()
    body = data.draw(_messages_bodies(), label="body")
    try:
        request = parse_messages_request(model, body)
        refuse_control_text(request, control_token_texts(tokenizer))
        chat = to_chat(request)
        request_grammar(chat)
        ids = chat_prompt(chat, tokenizer, 256)
    except APIError as exc:
        assert exc.status == 400 and exc.message and "Traceback" not in exc.message
        if isinstance(_loads_or_none(body), dict):
            assert exc.param is not None and exc.param.split(".")[0] in exc.message, exc.message
        json.dumps(exc.body())
        return
    assert ids and all(0 <= i < len(tokenizer) for i in ids)


@FUZZ
@given(data=st.data(), named=st.booleans(), reason=st.sampled_from(["stop", "length"]))
def test_a_streamed_tool_call_becomes_one_tool_use_whose_pieces_join_into_its_input(
    data: st.DataObject, named: bool, reason: str
) -> None:
    """A forced call's chat stream, in any pieces, as Anthropic's events: a whole call is one tool_use block whose
    `partial_json` pieces join into the chat call's arguments, ending with stop_reason tool_use; the blocks open and
    close in order."""
    pieces = data.draw(_answers(named), label="pieces")
    formatter = ToolCallFormatter(
        ToolCallMode("toggle" if named else None), None, "chatcmpl-fuzz", "tiny", tiny_tokenizer()
    )
    choices = [formatter.opening_choice(0), *(formatter.stream_choice(0, piece, None, None) for piece in pieces)]
    choices.append(formatter.stream_choice(0, "", reason, None))
    chunks = [json.dumps(formatter.chunk([choice])) for choice in choices if choice is not None] + ["[DONE]"]

    async def source() -> AsyncGenerator[str, None]:
        for chunk in chunks:
            yield chunk

    async def run() -> list[dict[str, Any]]:
        start = StreamStart("chatcmpl-fuzz", "tiny", 3, None)
        return [json.loads(str(e.data)) async for e in message_events(source(), start)]

    events = asyncio.run(run())
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"] and events[-1]["type"] == "message_stop"
    opened = [e["index"] for e in events if e["type"] == "content_block_start"]
    closed = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert opened == closed == list(range(len(opened)))
    finish = str(json.loads(chunks[-2])["choices"][0]["finish_reason"])
    reasons = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}
    assert events[-2]["delta"]["stop_reason"] == reasons[finish]
    if finish == "tool_calls":
        whole: Any = formatter.final_choice(0, "".join(pieces), reason, None)["message"]
        joined = "".join(
            e["delta"]["partial_json"]
            for e in events
            if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
        )
        assert json.loads(joined) == json.loads(whole["tool_calls"][0]["function"]["arguments"])
        assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"][-1] == "tool_use"


_SCHEMA_TEXT_FIELDS = {
    "guided_json": lambda text: text,
    "structured_outputs": lambda text: {"json": text},
    "response_format": lambda text: {"type": "json_schema", "json_schema": {"name": "x", "schema": text}},
}


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("field", sorted(_SCHEMA_TEXT_FIELDS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_json_text)
def test_schema_text_gives_a_grammar_or_a_400_naming_its_field(model: type[BaseModel], field: str, text: str) -> None:
    body = json.dumps({**_BASES[model], field: _SCHEMA_TEXT_FIELDS[field](text)}).encode()
    request = parse_request(model, body)  # a string is a string: only its own parse can fail
    try:
        spec = request_grammar(request).spec  # type: ignore[arg-type]
    except APIError as exc:
        assert exc.status == 400 and exc.param == field, exc.message
        assert "Traceback" not in exc.message
    else:
        assert spec is not None and spec.param == field


@FUZZ
@given(text=_json_text | st.text(max_size=200) | st.binary(max_size=64).map(lambda b: b.decode("latin-1")))
def test_json_out_of_a_string_parses_or_is_a_value_error(text: str) -> None:
    """The one parser the server reads JSON text with (schemas sent as text, generated tool calls): a value, or a
    ValueError the callers turn into a 400 (or into "not a whole call"), never RecursionError or anything else."""
    try:
        value = parse_json_text(text)
    except ValueError as exc:
        assert str(exc)
    else:
        json.dumps(value)  # within the limits, so it can be written back out


_CALL = {  # named: the arguments; "required": the wrapper around them (a brace inside a string too)
    True: json.dumps({"on": True, "tags": [1, {"a": "}"}]}),
    False: '{"name": "toggle", "parameters": {"on": true, "a": "}"}}',
}
_call_pieces = st.lists(
    st.sampled_from(["{", "}", '"name"', '"parameters"', '"toggle"', ":", ",", " ", "\n", '"', "\\", "\\u12", "[1"])
    | st.text(max_size=4),
    max_size=12,
)


@st.composite
def _answers(draw: st.DrawFn, named: bool) -> list[str]:
    """A forced call's text in pieces: a whole call, one cut anywhere (a stop string, max_tokens), or noise."""
    whole = _CALL[named] + draw(st.sampled_from(["", " ", "\n"]))
    text = draw(st.sampled_from([whole, whole[: draw(st.integers(0, len(whole)))]]))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    split = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return draw(st.sampled_from([split, draw(_call_pieces)]))


@FUZZ
@given(data=st.data(), named=st.booleans(), reason=st.sampled_from(["stop", "length"]))
def test_a_tool_call_is_reported_only_when_its_arguments_parse(data: st.DataObject, named: bool, reason: str) -> None:
    """Whole and streamed, a forced call's answer is a call (finish_reason "tool_calls") only when its arguments
    parse; otherwise it keeps the reason that ended it, and its text as is (it said "tool_calls" with `{`)."""
    pieces = data.draw(_answers(named), label="pieces")
    mode = ToolCallMode("toggle" if named else None)
    text = "".join(pieces)
    formatter = ToolCallFormatter(mode, None, "chatcmpl-fuzz", "tiny", tiny_tokenizer())
    choice = formatter.final_choice(0, text, reason, None)
    message = choice["message"]
    assert isinstance(message, dict)
    if choice["finish_reason"] == "tool_calls":
        arguments = message["tool_calls"][0]["function"]["arguments"]
        json.loads(arguments)
    else:
        assert choice["finish_reason"] == reason and message["content"] == text and "tool_calls" not in message
    streaming = ToolCallFormatter(mode, None, "chatcmpl-fuzz", "tiny", tiny_tokenizer())
    streaming.opening_choice(0)
    chunks = [streaming.stream_choice(0, piece, None, None) for piece in pieces]
    chunks.append(streaming.stream_choice(0, "", reason, None))
    streamed = "".join(
        call["function"].get("arguments", "")
        for chunk in chunks
        if chunk is not None
        for call in chunk["delta"].get("tool_calls", ())  # type: ignore[union-attr]
    )
    final = chunks[-1]
    assert final is not None and final["finish_reason"] == choice["finish_reason"]
    if choice["finish_reason"] == "tool_calls":
        assert streamed == arguments


# ----- /v1/responses: its body onto the chat request it runs as -----
_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"]) | _json},
    optional={"text": st.text(max_size=8) | _json},
)
_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "item_reference"]) | _json,
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | _json,
        "content": st.text(max_size=8) | st.lists(_part, max_size=2) | _json,
        "call_id": st.sampled_from(["c1", "c2", ""]) | _json,
        "name": st.sampled_from(["f", "g", ""]) | _json,
        "arguments": st.sampled_from(["{}", '{"a": 1}', "{"]) | _json,
        "output": st.text(max_size=8) | st.lists(_part, max_size=2) | _json,
    },
)
_flat_tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "web_search"]) | _json},
    optional={
        "name": st.sampled_from(["f", "g", ""]) | _json,
        "parameters": _schema | _json,
        "description": _json,
        "strict": _json,
    },
)
_RESPONSES_FIELD_VALUES = {
    "input": st.text(max_size=20) | st.lists(_item, max_size=4) | _json,
    "instructions": st.text(max_size=8) | _json,
    "tools": st.lists(_flat_tool, max_size=2) | _json,
    "tool_choice": st.sampled_from(["none", "auto", "required", "x"])
    | st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]), "name": st.sampled_from(["f", "g"])})
    | _json,
    "parallel_tool_calls": _json,
    "max_output_tokens": _json,
    "temperature": _json,
    "top_p": _json,
    "text": st.fixed_dictionaries(
        {},
        optional={
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema", "x"]) | _json},
                optional={"name": _json, "schema": _schema | _json | _json_text, "strict": _json},
            )
            | _json
        },
    )
    | _json,
    "stream": _json,
    "store": _json,
    "previous_response_id": _json,
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=8) | _json, max_size=3) | _json,
    "user": _json,
    "truncation": st.sampled_from(["disabled", "auto"]) | _json,
    "background": _json,
    "reasoning": _json,
    "model": _json,
    "unknown": _json,
}


def _responses_bodies() -> st.SearchStrategy[bytes]:
    overlay = st.lists(st.sampled_from(sorted(_RESPONSES_FIELD_VALUES)), min_size=1, max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: _RESPONSES_FIELD_VALUES[k] for k in keys})
    )
    return st.one_of(
        overlay.map(lambda fields: json.dumps({"input": "hello", **fields}).encode()),
        st.fixed_dictionaries({}, optional=_RESPONSES_FIELD_VALUES).map(lambda d: json.dumps(d).encode()),
        _json.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    )


@FUZZ
@given(body=_responses_bodies())
def test_any_responses_body_becomes_a_chat_request_or_a_named_400(body: bytes) -> None:
    """Parsing, the Responses checks and the translation onto a chat request (then the chat request's structured
    output, as the chat path takes it): a chat request, or a 400 whose param is a Responses field, never another
    exception. The chat path's own errors come back under the Responses field (ChatPlan.renamed)."""
    try:
        request = parse_request(ResponsesRequest, body)
        refused = responses_refusal(request)
        if refused is not None:
            raise refused
        plan = chat_plan(request, [])
    except APIError as exc:
        assert exc.status == 400 and exc.message and "Traceback" not in exc.message
        if isinstance(_loads_or_none(body), dict):
            assert exc.param in ResponsesRequest.model_fields, exc.param  # always one of the request's fields
        json.dumps(exc.body())
        return
    assert plan.chat.messages and len(plan.origins) == len(plan.chat.messages)
    _assert_storable(plan.chat)
    try:
        request_grammar(plan.chat)
    except APIError as exc:
        renamed = plan.renamed(exc)
        assert renamed.status == 400 and renamed.param in ResponsesRequest.model_fields, renamed.param


def _integer_fields(model: type[BaseModel]) -> list[str]:
    return [name for name, field in model.model_fields.items() if "int" in str(field.annotation)]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("value", [INT64_MAX + 1, -INT64_MAX - 2, 2**70])
def test_every_integer_field_past_int64_is_a_named_400(model: type[BaseModel], value: int) -> None:
    """The sweep the fuzzer found by luck once (min_tokens = 2**63 parsed): every integer field, every model."""
    fields = _integer_fields(model)
    assert {"max_tokens", "min_tokens", "n", "seed", "priority"} <= set(fields)
    for name in fields:
        body = json.dumps({**_BASES[model], name: value}).encode()
        with pytest.raises(APIError) as caught:
            parse_request(model, body)
        assert caught.value.status == 400 and caught.value.param == name, name


# ----- SSE framing -----
_FORMATTER: dict[bool, ResponseFormatter] = {
    False: CompletionFormatter("cmpl-fuzz", "tiny", tiny_tokenizer()),
    True: ChatFormatter("cmpl-fuzz", "tiny", tiny_tokenizer()),
}
_any_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=40)
_tricky = st.sampled_from(
    [
        "\n",
        "\r",
        "\r\n",
        "\n\n",
        "data: x",
        "\x00",
        "\u2028",
        "\u2029",
        "\x85",
        "\ufeff",
        "\ud800",
        "[DONE]",
        '"',
        "\\",
        "é",
        "😀",
        "\x1b[31m",
    ]
)
_texts = st.lists(_tricky | _any_text, max_size=5).map("".join)
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _frame(data: str) -> bytes:
    return ServerSentEvent(data=data, sep="\n").encode()


def _parse_sse(stream: bytes) -> list[str]:
    """A WHATWG-style event-stream parser: `data` lines joined by newlines, an event per blank line."""
    events: list[str] = []
    data: list[str] = []
    for line in _LINE_BREAK.split(stream.decode("utf-8")):
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    return events


def _strict_loads(payload: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(payload, parse_constant=refuse)


@FUZZ
@given(
    texts=st.lists(_texts, min_size=1, max_size=4),
    chat=st.booleans(),
    logprob=st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
)
def test_chunks_frame_as_one_data_line_and_round_trip(texts: list[str], chat: bool, logprob: float) -> None:
    formatter = _FORMATTER[chat]
    payloads = []
    for i, text in enumerate(texts):
        entries = [TokenLogprob(5, logprob, ((5, logprob), (6, logprob - 1.0)))]
        lp = formatter.logprobs(entries, 0, 2)
        chunk = formatter.chunk([formatter.stream_choice(i, text, None, lp)])
        payloads.append(json.dumps(chunk))
    payloads.append(json.dumps(APIError(500, "generation failed: " + texts[0]).body()))
    payloads.append("[DONE]")

    frames = [_frame(p) for p in payloads]
    for payload, frame in zip(payloads, frames, strict=True):
        assert frame == b"data: " + payload.encode("utf-8") + b"\n\n"
        assert not _LINE_BREAK.search(payload)  # one data line per event, whatever the text held
    events = _parse_sse(b"".join(frames))
    assert events == payloads
    for i, text in enumerate(texts):
        choice = _strict_loads(events[i])["choices"][0]  # type: ignore[index]
        assert (choice["delta"]["content"] if chat else choice["text"]) == text
    assert _strict_loads(events[-2])["error"]["message"] == "generation failed: " + texts[0]  # type: ignore[index]
    assert events[-1] == "[DONE]"
