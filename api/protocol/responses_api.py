"""Request models of OpenAI's Responses API (`POST /v1/responses`), under the rules of openai_api.py: null means the
default, unknown fields are ignored and logged, known values stay strict. The items of `input` are parsed loosely
here (one model for every item type) and checked item by item where they become chat messages
(api/translation/responses.py), so that a malformed item is a 400 naming it (`input[2]`), not a union's noise."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from api.protocol.errors import APIError, bad_request
from api.protocol.openai_api import INT64_MAX, _Lenient

METADATA_MAX_PAIRS = 16  # OpenAI's bounds on `metadata`, which the store keeps and every answer echoes
METADATA_MAX_KEY = 64
METADATA_MAX_VALUE = 512


class ContentPart(_Lenient):
    """A part of an item's content: `input_text` or `output_text` (other types are refused where it is read)."""

    type: str
    text: str | None = None


class InputItem(_Lenient):
    """One item of `input`: a `message` (the default type), a `function_call` or a `function_call_output`. Which
    fields each type needs is checked where the item becomes a chat message."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None


class TextConfig(_Lenient):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM's, as on chat
    truncation: str = "disabled"
    background: bool = False
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None  # a model without reasoning: accepted and ignored, as vLLM does


def responses_refusal(request: ResponsesRequest) -> APIError | None:
    """The first field whose value asks for what this server does not build, or breaks OpenAI's bounds."""
    if request.background:
        return bad_request("background responses are not supported by this server", param="background")
    if request.truncation not in ("disabled", "auto"):
        return bad_request(f"truncation must be 'disabled' or 'auto'; got {request.truncation[:40]!r}", "truncation")
    if request.truncation == "auto":
        return bad_request("truncation 'auto' is not supported by this server", param="truncation")
    if request.conversation is not None:
        return bad_request("conversations are not supported by this server; use previous_response_id", "conversation")
    if request.prompt is not None:
        return bad_request("prompt templates ('prompt') are not supported by this server", param="prompt")
    metadata = request.metadata or {}
    if len(metadata) > METADATA_MAX_PAIRS:
        return bad_request(f"metadata holds at most {METADATA_MAX_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY or len(value) > METADATA_MAX_VALUE:
            return bad_request(
                f"metadata keys are at most {METADATA_MAX_KEY} characters and values at most {METADATA_MAX_VALUE}",
                param="metadata",
            )
    return None
