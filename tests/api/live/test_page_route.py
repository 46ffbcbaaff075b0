"""`GET /` and its files over HTTP (the page in a browser: tests/api/live/test_browser_compare.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server_harness import RunningServer, mode_config, running_server

KEY = "page-route-key"


@pytest.fixture(scope="module")
def keyed_server(one_torch_thread: None) -> Iterator[RunningServer]:
    with running_server(mode_config("dynamic", api_key=KEY, cpu_kernels=False)) as server:
        yield server


def test_the_page_and_its_files_need_no_key_because_they_hold_no_data(keyed_server: RunningServer) -> None:
    page = httpx.get(keyed_server.base_url + "/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert 'src="static/app.js"' in page.text and 'href="static/style.css"' in page.text
    script = httpx.get(keyed_server.base_url + "/static/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "/v1/events" in script.text
    style = httpx.get(keyed_server.base_url + "/static/style.css")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")


def test_what_the_page_reads_needs_the_key(keyed_server: RunningServer) -> None:
    for path in ("/v1/compare/modes", "/v1/events"):
        assert httpx.get(keyed_server.base_url + path).status_code == 401
    modes = httpx.get(keyed_server.base_url + "/v1/compare/modes", headers={"Authorization": f"Bearer {KEY}"})
    assert modes.status_code == 200
    body = modes.json()
    assert [entry["mode"] for entry in body["data"]] == ["dynamic"]
    assert body["max_prompts"] == 32  # the send control's bound


@pytest.mark.parametrize("path", ["/static/index.html.bak", "/static/nope.js", "/static/..%2Fpage.py", "/static/"])
def test_only_the_page_files_are_served(keyed_server: RunningServer, path: str) -> None:
    response = httpx.get(keyed_server.base_url + path, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
