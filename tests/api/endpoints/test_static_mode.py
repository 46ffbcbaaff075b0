"""`--mode static` end to end: a real server answers and its timings name the mode and the batch (the exact
departure rules are pinned with a fake clock in tests/scheduler/test_static.py)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_harness import RunningServer, mode_config, running_server


@pytest.fixture(scope="module")
def static_server() -> Iterator[RunningServer]:
    with running_server(mode_config("static", max_batch_size=4, batch_window_ms=200.0)) as server:
        yield server


def complete(server: RunningServer, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_static_mode_serves_and_reports_its_batches(static_server: RunningServer) -> None:
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: complete(static_server, p), ["one two", "three four"]))
    for result in results:
        timings = result["timings"]
        assert timings["mode"] == "static" and timings["batch_id"] is not None
        assert result["usage"]["completion_tokens"] == 4
