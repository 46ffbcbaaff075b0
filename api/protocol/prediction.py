"""Predicted Outputs (OpenAI's `prediction`): the checks on the field, and the prediction as token ids.

The prediction only proposes drafts (scheduler/speculation.py); the answer is the one the request gets without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from api.protocol.errors import bad_request
from api.protocol.openai_api import SamplingFields

if TYPE_CHECKING:  # annotations only: the protocol package imports no transformers
    from transformers import PreTrainedTokenizerBase


def prediction_text(request: SamplingFields) -> str | None:
    """The predicted text, or None without a prediction; a 400 naming the field for a shape OpenAI does not take."""
    prediction = request.prediction
    if prediction is None:
        return None
    if prediction.type != "content":
        raise bad_request(f"prediction.type must be 'content', got {prediction.type!r}", param="prediction.type")
    content = prediction.content
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("prediction.content must be a string or a list of text parts", param="prediction.content")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"prediction.content[{i}] must be a text part ({{'type': 'text', 'text': ...}})",
                param=f"prediction.content.{i}",
            )
        texts.append(part["text"])
    return "".join(texts)


def prediction_token_ids(
    request: SamplingFields, tokenizer: PreTrainedTokenizerBase, max_model_len: int
) -> tuple[int, ...]:
    """The prediction tokenised as the answer would be (no special tokens); () without one. A prediction longer
    than the context could never be an answer: a 400 naming it, before it costs a lookup per step."""
    text = prediction_text(request)
    if not text:
        return ()
    ids = tuple(int(i) for i in tokenizer.encode(text, add_special_tokens=False))
    if len(ids) > max_model_len:
        raise bad_request(
            f"prediction.content is {len(ids)} tokens, more than the {max_model_len}-token context",
            param="prediction.content",
        )
    return ids
