"""`serve --policy MODULE:CLASS` end to end: the example plug-in policy serves requests through a real server, and a
policy that cannot load is refused when the config is built."""

from __future__ import annotations

import httpx
import pytest

from api.config import ServerConfig
from api.endpoints.state import ServerState
from scheduler.examples.shortest_prompt_first import ShortestPromptFirst
from tests.server_harness import mode_config, running_server

EXAMPLE = "scheduler.examples.shortest_prompt_first:ShortestPromptFirst"


def test_the_example_policy_serves_a_real_server() -> None:
    with running_server(mode_config("continuous", policy=EXAMPLE)) as server:
        runtime = ServerState.of(server.app).runtime  # type: ignore[arg-type]
        assert runtime is not None and isinstance(runtime.scheduler.policy, ShortestPromptFirst)
        body = {"prompt": "one two three", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4


def test_a_policy_that_cannot_load_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="cannot load the policy"):
        ServerConfig(policy="no_such_module:Policy")
