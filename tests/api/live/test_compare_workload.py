"""`POST /v1/compare/workload` on `batchserve compare --modes static,dynamic,continuous` with the tiny model: the
server starts the page's workload in every pane and streams every answer back on one stream; a bad body is a 400
naming the field; a client that leaves aborts everything it started and frees every seat."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.live.test_compare import _read_events, _wait_for
from tests.api.live.test_compare_modes import serving

KEY = "workload-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PANES = ["static", "dynamic", "continuous"]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving("static,dynamic,continuous", api_key=KEY) as url:
        yield url


def _item(index: int, max_tokens: int, delay_s: float = 0.0, prompt: str = "hello world") -> dict[str, Any]:
    return {"index": index, "prompt": prompt, "max_tokens": max_tokens, "delay_s": delay_s}


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                return
            yield json.loads(line[6:])


def _subscribe(base_url: str) -> tuple[list[tuple[str, dict[str, Any]]], threading.Event]:
    """The combined event stream, read in a thread until the returned event is set (and one more event comes)."""
    events: list[tuple[str, dict[str, Any]]] = []
    stop = threading.Event()
    url = f"{base_url}/v1/events?include_text=false"
    threading.Thread(target=_read_events, args=(url, stop, events), kwargs={"headers": AUTH}, daemon=True).start()
    _wait_for(lambda: {e["mode"] for kind, e in events if kind == "hello"} == set(PANES))
    return events, stop


def _at(events: list[tuple[str, dict[str, Any]]], point: str) -> dict[str, dict[str, Any]]:
    """The request events at one point of their lives (`queued`, `finished`, ...), by request id."""
    return {e["request_id"]: e for kind, e in events if kind == "request" and e["event"] == point}


def _running(base_url: str) -> dict[str, float]:
    """Requests running or waiting, per pane, from the root's /metrics."""
    text = httpx.get(f"{base_url}/metrics", headers=AUTH).text
    busy = dict.fromkeys(PANES, 0.0)
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            mode = line.split('mode="', 1)[1].split('"', 1)[0]
            busy[mode] += float(line.rsplit(" ", 1)[1])
    return busy


def test_a_workload_streams_every_panes_answers_on_one_stream(base_url: str) -> None:
    events, stop = _subscribe(base_url)
    # A long answer and two short ones at the start, and one more a fifth of a second later, in each pane.
    requests = [_item(0, 12), _item(1, 3), _item(2, 3), _item(3, 4, delay_s=0.2)]
    body = {"panes": PANES, "requests": requests, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/compare/workload", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        received = list(_events(response))
    assert {e["pane"] for e in received} == set(PANES)
    ids: dict[tuple[str, int], str] = {}
    for pane in PANES:
        for item in requests:
            own = [e for e in received if e["pane"] == pane and e["index"] == item["index"]]
            assert all(e["error"] is None for e in own), own
            assert own[0]["text"] == "" and own[0]["request_id"].startswith("cmpl-"), own[0]  # the start: its id
            assert [e["finish_reason"] for e in own if e["finish_reason"]] == ["length"], own
            assert "".join(e["text"] for e in own), own  # its text streamed
            ids[pane, item["index"]] = own[0]["request_id"]
    assert len(set(ids.values())) == len(ids)  # one scheduler request per pane and request
    for pane in PANES:  # the three leaving together are one request with three choices: <id>-0, -1, -2
        together = [ids[pane, i] for i in range(3)]
        assert [rid.rsplit("-", 1)[1] for rid in together] == ["0", "1", "2"]
        assert len({rid.rsplit("-", 1)[0] for rid in together}) == 1
    _wait_for(lambda: set(ids.values()) <= set(_at(events, "released")))
    stop.set()
    queued = _at(events, "queued")
    for (pane, _), rid in ids.items():
        assert queued[rid]["mode"] == pane  # each pane's requests went to its own queue, under the ids the page links
    for pane in PANES:  # the later arrival reached each queue after the first three
        assert all(queued[ids[pane, i]]["t"] < queued[ids[pane, 3]]["t"] for i in range(3))


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"panes": ["dynamic", "batching"]}, "panes"),
        ({"panes": ["dynamic", "dynamic"]}, "panes"),
        ({"panes": []}, "panes"),
        ({"requests": [_item(i, 2) for i in range(33)]}, "requests"),  # the server's --max-prompts is 32
        ({"requests": []}, "requests"),
        ({"requests": [_item(0, 0)]}, "requests.0.max_tokens"),
        ({"requests": [_item(0, 2), _item(1, 1025)]}, "requests.1.max_tokens"),
        ({"requests": [_item(0, 256)]}, "requests.0.max_tokens"),  # the tiny model's context is 256
        ({"requests": [_item(0, 2), _item(0, 2)]}, "requests.1.index"),
        ({"requests": [_item(0, 2, delay_s=-1.0)]}, "requests.0.delay_s"),
        ({"requests": [_item(0, 2, delay_s=121.0)]}, "requests.0.delay_s"),
        ({"requests": [_item(0, 2), _item(1, 2, delay_s=0.01)]}, "requests.1.delay_s"),  # 100 a second
        ({"requests": [{"index": 0, "prompt": "", "max_tokens": 2}]}, "requests.0.prompt"),
        ({"requests": [{**_item(0, 2), "temperature": 1.0}]}, "requests.0.temperature"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_a_bad_workload_gets_a_400_naming_the_field(base_url: str, change: dict[str, Any], param: str) -> None:
    body = {"panes": PANES, "requests": [_item(0, 2)], **change}
    answer = httpx.post(f"{base_url}/v1/compare/workload", json=body, headers=AUTH)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_workload_needs_the_key_and_json(base_url: str) -> None:
    body = {"panes": PANES, "requests": [_item(0, 2)]}
    refused = httpx.post(f"{base_url}/v1/compare/workload", json=body)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    text = httpx.post(f"{base_url}/v1/compare/workload", content=b"panes", headers=AUTH)
    assert text.status_code == 400 and "JSON" in text.json()["error"]["message"]
    assert httpx.get(f"{base_url}/v1/compare/workload", headers=AUTH).status_code == 405


def test_a_client_that_leaves_aborts_the_workload_and_frees_every_seat(base_url: str) -> None:
    events, stop = _subscribe(base_url)
    # Three long answers per pane now (every seat), and one more that should leave two seconds later.
    requests = [_item(0, 240), _item(1, 240), _item(2, 240), _item(3, 4, delay_s=2.0)]
    body = {"panes": PANES, "requests": requests, "ignore_eos": True}
    started: dict[str, set[str]] = {pane: set() for pane in PANES}
    streaming: set[str] = set()
    with httpx.stream("POST", f"{base_url}/v1/compare/workload", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        for event in _events(response):
            if event["request_id"]:
                started[event["pane"]].add(event["request_id"])
            if event["text"]:
                streaming.add(event["pane"])
            if streaming == set(PANES):
                break  # every pane is generating: leave
    left_at = time.monotonic()
    started_ids = {rid for ids in started.values() for rid in ids}
    assert all(len(ids) == 3 for ids in started.values()), started  # the later arrival had not left yet
    _wait_for(lambda: started_ids <= set(_at(events, "released")))
    _wait_for(lambda: sum(_running(base_url).values()) == 0)
    finished = _at(events, "finished")
    assert "abort" in {finished[rid]["outcome"] for rid in started_ids}, finished  # cut off, not run to their end
    time.sleep(max(0.0, 2.5 - (time.monotonic() - left_at)))  # past the later arrival's moment
    stop.set()
    queued = set(_at(events, "queued"))
    assert queued >= started_ids and not {rid for rid in queued - started_ids if rid.startswith("cmpl-")}
    assert _running(base_url) == dict.fromkeys(PANES, 0.0)
