"""Request models of the OpenAI-compatible API (pydantic, strict: "5" is not an integer)."""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import APIError, bad_request

# OpenAI parameters we know but do not implement: rejected by name rather than silently ignored.
UNSUPPORTED_PARAMS = frozenset(
    {
        "best_of",
        "logit_bias",
        "suffix",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "parallel_tool_calls",
        "modalities",
        "audio",
        "prediction",
        "store",
        "metadata",
        "service_tier",
        "reasoning_effort",
        "web_search_options",
    }
)

# No vocabulary has 2**31 entries. Bounding ids (and top_k) here keeps absurd values out of 32-bit tokenizer
# code and int64 engine rows, which raised past validation; the engine checks ids against the real vocabulary.
MAX_ID = 2**31 - 1
TokenIds = list[Annotated[int, Field(ge=0, le=MAX_ID)]]
_Model = TypeVar("_Model", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    # Floats refuse NaN and infinities as "not a finite number" rather than as out of range.
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=MAX_ID)  # -1 or 0: off (vLLM spells "off" as -1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5)


def parse_request(model: type[_Model], body: bytes) -> _Model:
    """Validate a JSON body into `model`, turning the first problem into a 400 that names the parameter."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def _to_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind = first["type"]
    loc = [str(part) for part in first["loc"]]
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}")
    if not loc:  # the body itself; a nested object of the wrong type (stream_options: "yes") names its field
        return bad_request("the request body must be a JSON object")
    # Union branches add their type name to the location (e.g. prompt.str); report the field itself.
    param = loc[0]
    if kind == "extra_forbidden":
        if param in UNSUPPORTED_PARAMS:
            return bad_request(f"the parameter '{param}' is not supported by this server", param=param)
        return bad_request(f"unknown parameter '{'.'.join(loc)}'", param=param)
    if kind == "missing":
        return bad_request(f"the required parameter '{'.'.join(loc)}' is missing", param=param)
    messages = {e["msg"] for e in errors if e["loc"] and str(e["loc"][0]) == param}
    detail = "; or ".join(sorted(messages)) if len(messages) <= 4 else first["msg"]
    return bad_request(f"invalid value for '{param}': {detail}", param=param)
