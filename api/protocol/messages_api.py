"""Request models and errors of Anthropic's Messages API (`POST /v1/messages` and `/v1/messages/count_tokens`),
which api/translation/ runs on the chat path.

The server's rules hold here too: null means a field's default, a field this server does not know is ignored (and
logged), values are strict. Content blocks are the text ones: `text`, `tool_use` and `tool_result`; a block of any
other type (an image, a document, thinking) is a 400 naming where it is. Errors are Anthropic's shape:
`{"type": "error", "error": {"type", "message"}}`, the message starting with the field's dotted path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, ValidationError
from starlette.responses import JSONResponse

from api.protocol.errors import APIError, bad_request
from api.protocol.openai_api import INT64_MAX, MAX_ID, _Lenient

_Model = TypeVar("_Model", bound=_Lenient)
# The paths whose errors, the API key's included, are in Anthropic's shape (under a mode's prefix in `compare`).
MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
BLOCK_TYPES = ("text", "tool_use", "tool_result")
# HTTP status -> Anthropic's error type (its documented table; 503 is how this server says overloaded).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# An OpenAI-shaped error's type (what a chat stream sends in-band) -> Anthropic's.
_FROM_OPENAI_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "timeout_error": "timeout_error",
    "service_unavailable": "overloaded_error",
    "internal_error": "api_error",
}


def is_messages_path(path: str) -> bool:
    return path.endswith(MESSAGES_PATHS)


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_event(openai_error: dict[str, Any]) -> dict[str, object]:
    """An OpenAI-shaped error body (a chat stream's in-band error) as Anthropic's `error` event."""
    error = openai_error.get("error") or {}
    kind = _FROM_OPENAI_TYPES.get(str(error.get("type")), "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(error.get("message", "internal error"))}}


def error_response(error: APIError) -> JSONResponse:
    body = {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str  # `cache_control` and `citations` are accepted and ignored (extra fields)


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Lenient):
    role: Literal["user", "assistant", "system"]  # "system": text at its place in the conversation
    content: str | list[ContentBlock]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(_Lenient):
    """A client tool; Anthropic's server tools (`bash_20250124`, `web_search_...`) are types this server lacks."""

    type: Literal["custom"] = "custom"
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": which one
    disable_parallel_tool_use: bool = False


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    format: OutputFormat | None = None  # structured output: the answer's text matches the schema
    effort: str | None = None  # accepted, and changes nothing here


class Metadata(_Lenient):
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(_Lenient):
    """`POST /v1/messages/count_tokens`: what `messages` would render, without `max_tokens` and sampling."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(block.text for block in self.system)


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`. Ranges are Anthropic's (temperature 0 to 1), within what the chat path takes."""

    max_tokens: int = Field(ge=0, le=INT64_MAX)  # 0: prefill only (it warms the prefix cache), as Anthropic
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=MAX_ID)  # 0 or absent: off
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None


def parse_messages_request(model: type[_Model], body: bytes) -> _Model:
    """Validate a JSON body, turning the first problem into a 400 whose message starts with the field's dotted path
    (`messages.1.content.0.type: ...`, as Anthropic words them) and whose `param` is its top-level field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise named_error(exc) from None


def named_error(exc: ValidationError) -> APIError:
    """The first problem, named by its dotted path (a union's own branch names left out)."""
    errors = exc.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {errors[0]['msg']}")
    if not errors[0]["loc"]:
        return bad_request("the request body must be a JSON object")
    # A union tries each branch: the deepest error is the one inside the branch the value meant (a list of blocks
    # rather than a string), and errors at the same path are its alternatives ("a valid string; or a valid list").
    deepest = max(errors, key=lambda error: len(error["loc"]))
    path = _path(deepest["loc"])
    kind = deepest["type"]
    if kind == "union_tag_invalid":
        tag = str(deepest.get("ctx", {}).get("tag", "?"))[:40]
        message = f"{path}.type: blocks of type {tag!r} are not supported; use one of {', '.join(BLOCK_TYPES)}"
    elif kind == "union_tag_not_found":
        message = f"{path}: a content block needs its 'type' ({', '.join(BLOCK_TYPES)})"
    elif kind == "missing":
        message = f"{path}: field required"
    else:
        alternatives = sorted({error["msg"] for error in errors if _path(error["loc"]) == path})
        message = f"{path}: {'; or '.join(alternatives[:4])}"
    return bad_request(message, param=str(deepest["loc"][0]))


def _path(loc: tuple[int | str, ...]) -> str:
    """The field's dotted path, without the branch names a union adds: `content.str`, `content.list[...]`, and a
    block's tag after its index (`content.list[...].0.text.text` is `content.0.text`)."""
    kept: list[str] = []
    for i, part in enumerate(loc):
        union_branch = part == "str" or (isinstance(part, str) and part.startswith("list["))
        block_tag = part in BLOCK_TYPES and i > 0 and isinstance(loc[i - 1], int)
        if not union_branch and not block_tag:
            kept.append(str(part))
    return ".".join(kept)
