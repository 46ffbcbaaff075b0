"""Request models of the OpenAI-compatible API, accepting what vLLM's server accepts for a text model.

Three rules, as in vLLM:
- `null` for an optional field means its default (clients pass unset fields through as null);
- a field this server does not know is ignored, and logged (vLLM's `extra="allow"` and its warning);
- a known field whose value would change the answer in a way that is not built is a 400 naming it
  (`refusal()`); its no-op values (`best_of` equal to `n`, `functions: []`, ...) are accepted. Structured outputs
  and tools are checked by api/structured/.
Values of known fields stay strict: "5" is not an integer and a range error names the field.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from api.protocol.errors import APIError, bad_request

# No vocabulary has 2**31 entries. Bounding ids (and top_k) here keeps absurd values out of 32-bit tokenizer
# code and int64 engine rows, which raised past validation; the engine checks ids against the real vocabulary.
MAX_ID = 2**31 - 1
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
# Every other integer must fit the engine's int64 rows; past that it is a named 400, not an overflow later.
INT64_MAX = 2**63 - 1
TokenIds = list[Annotated[int, Field(ge=0, le=MAX_ID)]]
_Model = TypeVar("_Model", bound=BaseModel)
# OpenAI's message roles ("function": its legacy tool result). Templates render the role raw, so no other text.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class _Lenient(BaseModel):
    """Strict values, unknown keys kept aside (`model_extra`), and null meaning the default."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        required = {name for name, f in cls.model_fields.items() if f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k in required}

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of the keys this server does not know, here and in nested objects."""
        names = [f"{prefix}{k}" for k in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, _Lenient):
                    where = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                    names.extend(item.ignored_fields(where))
        return names


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class ResponseFormat(_Lenient):
    type: str


class TextPart(_Lenient):
    type: str
    text: str | None = None


class Prediction(_Lenient):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (api/protocol/prediction.py checks it)."""

    type: str
    content: Any = None  # a string or a list of text parts; checked there, to name which


class SamplingFields(_Lenient):
    """Fields both endpoints share: sampling, stopping, streaming and vLLM's extensions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)  # vLLM has no upper bound (OpenAI's is 2)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=MAX_ID)  # -1 or 0: off (vLLM spells "off" as -1)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    n: int = Field(1, ge=1, le=INT64_MAX)
    best_of: int | None = Field(None, ge=1, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=INT64_MAX
    )  # keep the last k prompt tokens; -1: the context
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    add_special_tokens: bool | None = None  # default differs: True for completions, False for chat
    user: str | None = None
    request_id: str | None = Field(None, max_length=256)
    priority: int = Field(0, ge=-INT64_MAX - 1, le=INT64_MAX)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM's: prefix-cache sharing group
    prediction: Prediction | None = None  # drafts for speculative decoding; the answer is the same without
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)  # beam search only: a no-op otherwise, as in vLLM
    response_format: ResponseFormat | None = None
    logits_processors: list[Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int = Field(16, ge=0, le=INT64_MAX)  # 0 with echo scores the prompt alone
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None


class ChatMessage(_Lenient):
    """One turn: one of OpenAI's roles (CHAT_ROLES), text content only."""

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: at most one call
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


class TokenizeRequest(_Lenient):
    """`POST /tokenize` (vLLM's): a `prompt` as /v1/completions takes one, or `messages` rendered as
    /v1/chat/completions renders them (`as_completion()` and `as_chat()` give those endpoints' requests)."""

    model: str | None = None
    prompt: str | TokenIds | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default as vLLM: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    def as_completion(self) -> CompletionRequest:
        # Both parsed already with the same field types: no second validation.
        return CompletionRequest.model_construct(prompt=self.prompt, add_special_tokens=self.add_special_tokens)

    def as_chat(self) -> ChatCompletionRequest:
        fields = ("messages", "add_special_tokens", "add_generation_prompt", "continue_final_message")
        options = ("chat_template", "chat_template_kwargs", "tools")
        return ChatCompletionRequest.model_construct(**{name: getattr(self, name) for name in (*fields, *options)})


class DetokenizeRequest(_Lenient):
    """`POST /detokenize` (vLLM's)."""

    model: str | None = None
    tokens: TokenIds


def parse_request(model: type[_Model], body: bytes) -> _Model:
    """Validate a JSON body into `model`, turning the first problem into a 400 that names the parameter."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def validate_request(model: type[_Model], data: dict[str, Any]) -> _Model:
    """`parse_request` for a body built in the server (another API's request translated into this one's)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def parse_json_text(text: str) -> Any:
    """JSON out of a string a request carries (a schema sent as text) or the model wrote (a tool call), under the
    limits the body itself is parsed under: the same parser as `parse_request` (pydantic-core's), which refuses
    nesting past 200 levels and integers of more than 4,300 digits with a ValueError. Python's json module would
    raise RecursionError on deep nesting instead, which no caller expects."""
    return pydantic_core.from_json(text)


def _unsupported(param: str, what: str) -> APIError:
    return bad_request(f"{what} is not supported by this server", param=param)


def refusal(request: SamplingFields, by_priority: bool = False) -> APIError | None:
    """The first field whose value would change the answer in a way this server does not build. `by_priority`:
    the server schedules by priority (`--scheduling-policy priority`), so a non-zero `priority` is taken."""
    if request.best_of is not None and request.best_of != request.n:
        return _unsupported("best_of", f"'best_of' other than n ({request.best_of} with n={request.n})")
    if request.use_beam_search:
        return _unsupported("use_beam_search", "beam search ('use_beam_search')")
    if request.structural_tag is not None:
        return _unsupported("structural_tag", "structured output ('structural_tag')")
    if request.logits_processors:
        return _unsupported("logits_processors", "'logits_processors'")
    if request.bad_words:
        return _unsupported("bad_words", "'bad_words'")
    if request.priority != 0 and not by_priority:
        return _unsupported(
            "priority", "priority scheduling ('priority' other than 0, without --scheduling-policy priority)"
        )
    if request.stream and request.prompt_logprobs is not None:
        return bad_request("'prompt_logprobs' is not available when streaming", param="prompt_logprobs")
    if isinstance(request, CompletionRequest) and request.suffix:
        return _unsupported("suffix", "'suffix'")
    if isinstance(request, ChatCompletionRequest):
        return _chat_refusal(request)
    return None


def _chat_refusal(request: ChatCompletionRequest) -> APIError | None:
    if request.functions:
        return _unsupported("functions", "function calling ('functions')")
    if request.function_call is not None and request.function_call not in ("none", "auto"):
        return _unsupported("function_call", f"function_call {request.function_call!r}")
    if request.modalities is not None and any(m != "text" for m in request.modalities):
        return _unsupported("modalities", "output other than text ('modalities')")
    for name in ("audio", "web_search_options", "chat_template", "documents"):
        if getattr(request, name) is not None:
            return _unsupported(name, f"'{name}'")
    if request.add_generation_prompt and request.continue_final_message:
        return bad_request(
            "add_generation_prompt and continue_final_message cannot both be true", param="continue_final_message"
        )
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:  # the template renders the role raw: it must be a role, not text
            return bad_request(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {message.role[:40]!r}",
                param="messages",
            )
        if isinstance(message.content, list):
            for part in message.content:
                if part.type != "text":
                    return bad_request(
                        f"messages[{i}] has a content part of type '{part.type}'; this server serves a text model",
                        param="messages",
                    )
                if part.text is None:
                    return bad_request(f"messages[{i}]: a text content part needs its 'text'", param="messages")
    return None


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
    if kind == "missing":
        return bad_request(f"the required parameter '{'.'.join(loc)}' is missing", param=param)
    messages = {e["msg"] for e in errors if e["loc"] and str(e["loc"][0]) == param}
    detail = "; or ".join(sorted(messages)) if len(messages) <= 4 else first["msg"]
    return bad_request(f"invalid value for '{param}': {detail}", param=param)
