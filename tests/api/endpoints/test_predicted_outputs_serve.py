"""Predicted Outputs (`prediction`) end to end on the tiny model: on both endpoints, streamed or not, greedy answers
are the same with a prediction as without; a right prediction is counted as accepted in
`usage.completion_tokens_details`, a wrong one as rejected. The counting runs with a fixed draft length: by default
the draft-length rule reads wall-clock step costs, so on a busy machine it may verify few drafts (the rule has its
own tests); without --speculative-config a prediction is still drafted and judged. The real model's case, where the
prediction is accepted whole, is in tests/api/endpoints/test_api_real_model.py; a malformed prediction is in
test_bad_input.py's corpus."""

from __future__ import annotations

import pytest

from tests.server_harness import mode_config, openai_client, running_server

PROMPT = "the cat sat on the mat"
MESSAGES = [{"role": "user", "content": "say something"}]
FIXED_LENGTH = '{"method": "ngram", "num_speculative_tokens": 4, "draft_length": "fixed"}'


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
def test_a_prediction_changes_no_answer_and_is_counted(mode: str, one_torch_thread: None) -> None:
    with running_server(mode_config(mode, speculative_config=FIXED_LENGTH)) as server:
        client = openai_client(server)
        plain = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0)
        answer = plain.choices[0].text
        assert plain.usage is not None and plain.usage.completion_tokens_details is None  # no prediction, no counts
        right = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"prediction": {"type": "content", "content": answer}},
        )  # fmt: skip
        assert right.choices[0].text == answer
        details = right.usage.completion_tokens_details if right.usage else None
        # the tiny model's random tokens do not all survive decoding and encoding again, so some drafts miss
        assert details is not None and details.accepted_prediction_tokens and details.accepted_prediction_tokens > 0
        assert details.rejected_prediction_tokens is not None
        wrong = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"prediction": {"type": "content", "content": [{"type": "text", "text": "zq" * 30}]}},
        )  # fmt: skip
        assert wrong.choices[0].text == answer
        details = wrong.usage.completion_tokens_details if wrong.usage else None
        assert details is not None and details.rejected_prediction_tokens and details.rejected_prediction_tokens > 0

        chat = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=20, temperature=0)
        reply = chat.choices[0].message.content or ""
        stream = client.chat.completions.create(
            model="tiny-llama", messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, prediction={"type": "content", "content": reply},
        )  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens_details is not None
        assert (usage.completion_tokens_details.accepted_prediction_tokens or 0) > 0

        chat_predicted = client.chat.completions.create(
            model="tiny-llama", messages=MESSAGES, max_tokens=20, temperature=0,
            prediction={"type": "content", "content": reply},
        )  # fmt: skip
        assert chat_predicted.choices[0].message.content == reply
        details = chat_predicted.usage.completion_tokens_details if chat_predicted.usage else None
        assert details is not None and (details.accepted_prediction_tokens or 0) > 0
        completion_stream = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"prediction": {"type": "content", "content": answer}},
        )  # fmt: skip
        pieces = list(completion_stream)
        assert "".join(p.choices[0].text for p in pieces if p.choices) == answer
        final = pieces[-1].usage
        assert final is not None and final.completion_tokens_details is not None
        assert (final.completion_tokens_details.accepted_prediction_tokens or 0) > 0


def test_a_prediction_without_speculative_config_is_judged(one_torch_thread: None) -> None:
    with running_server(mode_config("continuous")) as server:
        client = openai_client(server)
        plain = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0)
        answer = plain.choices[0].text
        predicted = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"prediction": {"type": "content", "content": answer}},
        )  # fmt: skip
        assert predicted.choices[0].text == answer
        details = predicted.usage.completion_tokens_details if predicted.usage else None
        # the first step at a row count verifies every draft, whatever the rule has measured
        assert details is not None
        assert (details.accepted_prediction_tokens or 0) + (details.rejected_prediction_tokens or 0) > 0


def test_a_verify_steps_tokens_stream_as_one_chunk_with_every_logprob(one_torch_thread: None) -> None:
    """The accepted drafts of a step reach the client together (the scheduler flags a step's tokens, the stream
    merges them): fewer chunks than tokens, and every token's logprob and text still there, in order."""
    with running_server(mode_config("continuous", speculative_config=FIXED_LENGTH)) as server:
        client = openai_client(server)
        plain = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1)
        answer, logprobs = plain.choices[0].text, plain.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens is not None
        stream = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1, stream=True,
            stream_options={"include_usage": True},
            extra_body={"prediction": {"type": "content", "content": answer}},
        )  # fmt: skip
        chunks = [c for c in stream if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens]
        tokens = [token for c in chunks for token in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
        assert tokens == logprobs.tokens and "".join(c.choices[0].text for c in chunks) == answer
        assert len(chunks) < len(tokens)  # drafts were accepted, several tokens a chunk
