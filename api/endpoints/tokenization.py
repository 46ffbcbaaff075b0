"""The answers of `POST /tokenize` and `POST /detokenize`, shaped as vLLM's: a prompt goes through the completions
endpoint's tokenisation and messages through the chat endpoint's rendering (api/text/prompts.py), so a count is
the `usage.prompt_tokens` those endpoints would report."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from api.config import ServerConfig
from api.protocol.errors import bad_request
from api.protocol.openai_api import DetokenizeRequest, TokenizeRequest, refusal
from api.text.prompts import chat_prompt, completion_prompts
from api.text.tool_template import ChatSetup


def tokenize(
    request: TokenizeRequest,
    tokenizer: PreTrainedTokenizerBase,
    config: ServerConfig,
    max_model_len: int,
    chat: ChatSetup | None = None,
) -> dict[str, object]:
    """`{"count", "max_model_len", "tokens"}`, with `token_strs` when asked. A prompt longer than the context is
    counted, not refused: comparing `count` with `max_model_len` is what a client tokenises for. `chat`: the server's
    chat rendering, so messages count as the chat endpoint renders them."""
    if request.prompt is None and request.messages is None:
        raise bad_request("the request needs 'prompt' (text or token ids) or 'messages'", param="prompt")
    if request.prompt is not None and request.messages is not None:
        raise bad_request("give 'prompt' or 'messages', not both", param="messages")
    if request.messages is not None:
        refused = refusal(request.as_chat())  # what the chat endpoint refuses before rendering (unknown part types)
        if refused is not None:
            raise refused
        ids = chat_prompt(request.as_chat(), tokenizer, max_model_len, chat)
    else:
        [ids] = completion_prompts(request.as_completion(), tokenizer, config, max_model_len)
        check_vocabulary(ids, tokenizer, "prompt")
    answer: dict[str, object] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if request.return_token_strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return answer


def detokenize(request: DetokenizeRequest, tokenizer: PreTrainedTokenizerBase) -> dict[str, object]:
    """`{"prompt"}`: the ids' text with special tokens kept, so tokenize then detokenize gives the text back."""
    check_vocabulary(request.tokens, tokenizer, "tokens")
    return {"prompt": tokenizer.decode(request.tokens)}


def check_vocabulary(ids: list[int], tokenizer: PreTrainedTokenizerBase, param: str) -> None:
    """A 400 naming `param` for an id the tokenizer cannot name (its decode would drop it without a word)."""
    size = len(tokenizer)
    outside = next((i for i in ids if not 0 <= i < size), None)
    if outside is not None:
        raise bad_request(f"'{param}' holds token id {outside}, which is outside the vocabulary [0, {size})", param)
