"""Every check the engine makes on a request's sampling values is reachable from the API, and answered with a
400 naming the request field: never a 500, never a traceback in the log.

The cases are derived from the engine's own code: every `raise SamplingParamsError(..., InputField.X)` in
engine/sample/sampling_params.py (read with `ast`, loops over field names unrolled) must have a request below that
reaches it, in both modes, on both endpoints, streaming and not. The requests carry values the request models
let through (so it is the engine's check that answers), or, where the API's narrower range catches the value
first, the API's 400 names the same field.
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

import engine.sample.sampling_params
from api.protocol.engine_fields import _PARAMS
from engine.errors import InputField

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GOOD: dict[str, dict[str, object]] = {
    COMPLETIONS: {"prompt": "hello world", "max_tokens": 4},
    CHAT: {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
}

# One request per field the engine checks: values that pass the request models where one exists.
CASES: dict[InputField, dict[str, object]] = {
    InputField.MAX_TOKENS: {"max_tokens": -1},
    InputField.TEMPERATURE: {"temperature": -0.5},
    InputField.TOP_P: {"top_p": 0.0},
    InputField.TOP_K: {"top_k": 2**40},
    InputField.SEED: {"seed": 2**64},  # every int64 seed is folded into the engine's range; past int64, the API's
    InputField.LOGPROBS: {"logprobs": -1},
    InputField.PROMPT_LOGPROBS: {"prompt_logprobs": -1},
    InputField.PRESENCE_PENALTY: {"presence_penalty": 1e7},
    InputField.FREQUENCY_PENALTY: {"frequency_penalty": -1e7},
    InputField.MIN_TOKENS: {"min_tokens": -2},
    InputField.REPETITION_PENALTY: {"repetition_penalty": 0.0},
    InputField.MIN_P: {"min_p": 1.5},
    InputField.LOGIT_BIAS: {"logit_bias": {"1": 1, "01": 1}},  # one token id in two spellings
    InputField.ALLOWED_TOKEN_IDS: {"allowed_token_ids": []},
}


def engine_checked_fields() -> set[InputField]:
    """The InputField of every SamplingParamsError raised in engine/sample/sampling_params.py."""
    tree = ast.parse(Path(engine.sample.sampling_params.__file__).read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def loop_values(node: ast.AST, variable: str) -> list[str]:
        """What `variable` takes in the innermost enclosing `for variable in ("a", "b")`."""
        while not (isinstance(node, ast.For) and getattr(node.target, "id", None) == variable):
            node = parents[node]
        assert isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple)
        return [elt.value for elt in node.iter.elts if isinstance(elt, ast.Constant)]

    found: set[InputField] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
            continue
        assert getattr(node.exc.func, "id", None) == "SamplingParamsError", "the engine raises only typed errors"
        field = node.exc.args[1]
        if isinstance(field, ast.Attribute):
            found.add(InputField[field.attr])
        else:  # InputField[name.upper()]
            assert isinstance(field, ast.Subscript)
            variable = field.slice.func.value.id  # type: ignore[attr-defined]
            found |= {InputField[name.upper()] for name in loop_values(node, variable)}
    return found


def test_every_engine_check_has_a_case_here() -> None:
    checked = engine_checked_fields()
    assert InputField.ALLOWED_TOKEN_IDS in checked and InputField.PROMPT_LOGPROBS in checked  # the walk works
    assert checked <= set(CASES), f"engine checks without an API case: {checked - set(CASES)}"


def _send(server: Any, endpoint: str, changes: dict[str, object], stream: bool) -> httpx.Response:
    body = {**GOOD[endpoint], **changes, "stream": stream}
    if endpoint == CHAT and "logprobs" in changes:  # chat spells the count top_logprobs
        body["logprobs"] = True
        body["top_logprobs"] = changes["logprobs"]
    return httpx.post(
        f"{server.base_url}{endpoint}",
        content=json.dumps(body),
        timeout=60,
        headers={"content-type": "application/json"},
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT], ids=["cmpl", "chat"])
@pytest.mark.parametrize("field", sorted(CASES, key=lambda f: f.name), ids=lambda f: f.name.lower())
def test_an_engine_refusal_is_a_400_naming_the_field(
    server: Any, logs: pytest.LogCaptureFixture, field: InputField, endpoint: str, stream: bool
) -> None:
    response = _send(server, endpoint, CASES[field], stream)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    expected = "top_logprobs" if endpoint == CHAT and field == InputField.LOGPROBS else _PARAMS[field]
    assert error["param"] == expected, error
    assert not [r for r in logs.records if r.levelno >= logging.ERROR or r.exc_info], "a bad request logged an error"


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT], ids=["cmpl", "chat"])
def test_after_every_refusal_the_server_still_answers(server: Any, endpoint: str) -> None:
    """Runs after the refusals above (pytest keeps the file's order), on the same module's servers."""
    good = httpx.post(f"{server.base_url}{endpoint}", json=GOOD[endpoint], timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
