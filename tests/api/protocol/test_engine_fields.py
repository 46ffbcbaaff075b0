"""api.protocol.engine_fields: the engine's input errors become 400s naming the request field and what to change."""

from __future__ import annotations

import pytest

from api.protocol.engine_fields import engine_input_error
from engine.errors import CacheCapacityError, ContextLengthError, EngineInputError, InputField


@pytest.mark.parametrize("field", list(InputField), ids=lambda f: f.name)
def test_every_engine_field_names_a_request_parameter(field: InputField) -> None:
    error = engine_input_error(EngineInputError("something is wrong", field))
    assert error.status == 400 and error.message == "something is wrong"
    assert error.param == field.name.lower()  # the engine's names are the request fields' names today


@pytest.mark.parametrize(
    ("error", "remedy"),
    [
        (ContextLengthError("too long", InputField.PROMPT), "too long; shorten the prompt or lower max_tokens"),
        (CacheCapacityError("too big", InputField.MAX_TOKENS), "too big; raise kv_cache_tokens or lower max_tokens"),
    ],
)
def test_size_errors_say_what_the_client_or_operator_can_change(error: EngineInputError, remedy: str) -> None:
    assert engine_input_error(error).message == remedy
