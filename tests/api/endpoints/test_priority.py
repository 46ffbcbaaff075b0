"""`priority` through the API: a 400 naming it under fcfs (as vLLM), taken under --scheduling-policy priority."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server_harness import RunningServer, mode_config, running_server


@pytest.fixture(scope="module")
def priority_server() -> Iterator[RunningServer]:
    with running_server(mode_config("continuous", scheduling_policy="priority")) as server:
        yield server


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_priority_server_takes_the_field_on_both_endpoints(priority_server: RunningServer, path: str) -> None:
    body: dict[str, object] = {"max_tokens": 3, "temperature": 0, "priority": -7}
    body.update({"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    response = httpx.post(f"{priority_server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_an_fcfs_server_refuses_a_non_zero_priority_naming_the_flag(server: RunningServer) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "priority": 2}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
