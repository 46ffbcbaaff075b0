"""`POST /v1/compare/workload` on `batchserve compare --modes static,dynamic,continuous` with the tiny model: the
server starts the page's workload in every pane and streams every answer back on one stream; a bad body is a 400
naming the field; a client that leaves aborts everything it started and frees every seat; one workload runs at a
time (`--max-workloads`), the next gets a 429 until the running one's stream ends, however it ends."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import api.live.workload
from api.cli import build_parser
from tests.server_harness import lineup_server, read_events, wait_until

KEY = "workload-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PANES = ["static", "dynamic", "continuous"]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with lineup_server("static,dynamic,continuous", api_key=KEY) as url:
        yield url


def _item(index: int, max_tokens: int, delay_s: float = 0.0, prompt: str = "hello world") -> dict[str, Any]:
    return {"index": index, "prompt": prompt, "max_tokens": max_tokens, "delay_s": delay_s}


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                return
            yield json.loads(line[6:])


def _run(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A workload's events, read to its end."""
    with httpx.stream("POST", f"{base_url}/v1/compare/workload", json=body, headers=AUTH, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        return list(_events(answer))


def _run_when_free(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """`body` started once the server has a free workload slot, read to its end. A workload whose client left,
    or whose stream failed, gives its slot back once the server has noticed."""
    received: list[dict[str, Any]] = []

    def started() -> bool:
        with httpx.stream("POST", f"{base_url}/v1/compare/workload", json=body, headers=AUTH, timeout=120) as answer:
            if answer.status_code == 429:
                return False
            assert answer.status_code == 200, answer.read()
            received.extend(_events(answer))
            return True

    wait_until(started, timeout_s=60.0)
    return received


def _all_finished(received: list[dict[str, Any]], panes: list[str], count: int) -> bool:
    ends = [(e["pane"], e["index"]) for e in received if e["finish_reason"] and e["error"] is None]
    return sorted(ends) == sorted((pane, i) for pane in panes for i in range(count))


def _subscribe(base_url: str) -> tuple[list[tuple[str, dict[str, Any]]], threading.Event]:
    """The combined event stream, read in a thread until the returned event is set (and one more event comes)."""
    events: list[tuple[str, dict[str, Any]]] = []
    stop = threading.Event()
    url = f"{base_url}/v1/events?include_text=false"
    threading.Thread(target=read_events, args=(url, stop, events), kwargs={"headers": AUTH}, daemon=True).start()
    wait_until(lambda: {e["mode"] for kind, e in events if kind == "hello"} == set(PANES), timeout_s=60.0)
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
    wait_until(lambda: set(ids.values()) <= set(_at(events, "released")), timeout_s=60.0)
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
    wait_until(lambda: started_ids <= set(_at(events, "released")), timeout_s=60.0)
    wait_until(lambda: sum(_running(base_url).values()) == 0, timeout_s=60.0)
    finished = _at(events, "finished")
    assert "abort" in {finished[rid]["outcome"] for rid in started_ids}, finished  # cut off, not run to their end
    time.sleep(max(0.0, 2.5 - (time.monotonic() - left_at)))  # past the later arrival's moment
    stop.set()
    queued = set(_at(events, "queued"))
    assert queued >= started_ids and not {rid for rid in queued - started_ids if rid.startswith("cmpl-")}
    assert _running(base_url) == dict.fromkeys(PANES, 0.0)
    short = {"panes": PANES, "requests": [_item(0, 2)]}
    assert _all_finished(_run_when_free(base_url, short), PANES, 1)  # its workload slot was returned too


def _held(panes: list[str]) -> dict[str, Any]:
    """A workload whose first answer ends at once, while its last request leaves only 120 s after its start: it
    holds its slot until its client leaves."""
    return {"panes": panes, "requests": [_item(0, 4), _item(1, 2, delay_s=120.0)], "ignore_eos": True}


def _first_answers(events: Iterator[dict[str, Any]], panes: list[str]) -> list[dict[str, Any]]:
    """A stream's events until its request 0 has ended in every pane."""
    received: list[dict[str, Any]] = []
    for event in events:
        received.append(event)
        if _all_finished(received, panes, 1):
            return received
    raise AssertionError(f"the stream ended first: {received}")


def test_one_workload_runs_at_a_time_and_the_next_gets_a_429_naming_the_limit(base_url: str) -> None:
    url = f"{base_url}/v1/compare/workload"
    short = {"panes": PANES, "requests": [_item(0, 2), _item(1, 2)]}
    with httpx.stream("POST", url, json=_held(PANES), headers=AUTH, timeout=120) as running:
        assert running.status_code == 200
        events = _events(running)  # kept: a discarded line iterator closes the connection
        received = _first_answers(events, PANES)
        refused = httpx.post(url, json=short, headers=AUTH)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "5", refused.text
        error = refused.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "too_many_requests", None)
        assert "at most 1 workload at a time" in error["message"] and "--max-workloads" in error["message"], error
        assert all(e["error"] is None for e in received)  # the running one is untouched
    assert _all_finished(_run_when_free(base_url, short), PANES, 2)  # its client left: its slot came back
    assert _all_finished(_run(base_url, short), PANES, 2)  # one that ended gave its slot back before its [DONE]


def test_a_refused_body_holds_no_slot_and_a_failed_workload_returns_its_own(
    base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{base_url}/v1/compare/workload"
    short = {"panes": PANES, "requests": [_item(0, 2)]}
    assert _all_finished(_run_when_free(base_url, short), PANES, 1)  # the slot is free now
    bad = {"panes": PANES, "requests": [_item(0, 0)]}
    assert httpx.post(url, json=bad, headers=AUTH).status_code == 400
    assert _all_finished(_run(base_url, short), PANES, 1)  # the 400 took no slot

    original = api.live.workload._Fanout.frames

    async def failing(self: Any) -> Any:  # a fault inside the running stream, after its first event
        async for frame in original(self):
            yield frame
            raise RuntimeError("injected into the workload's stream")

    monkeypatch.setattr(api.live.workload._Fanout, "frames", failing)
    lines: list[str] = []
    with httpx.stream("POST", url, json=short, headers=AUTH, timeout=120) as broken:
        assert broken.status_code == 200
        with contextlib.suppress(httpx.HTTPError):  # the server cuts the stream off
            lines += broken.iter_lines()
    assert "data: [DONE]" not in lines
    monkeypatch.undo()
    assert _all_finished(_run_when_free(base_url, short), PANES, 1)
    wait_until(lambda: sum(_running(base_url).values()) == 0, timeout_s=60.0)


def test_max_workloads_is_a_flag_of_serve_and_compare_and_must_be_positive() -> None:
    for command in ("serve", "compare"):
        args = build_parser().parse_args([command, "--max-workloads", "3"])
        assert args.max_workloads == 3
    assert build_parser().parse_args(["compare"]).max_workloads == 1
    for value in ("0", "-1"):  # the flag's range (tests/api/test_flag_ranges.py checks every flag's message)
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(["compare", "--max-workloads", value])
        assert exited.value.code == 2


def test_a_server_with_max_workloads_2_runs_two_and_refuses_a_third() -> None:
    pane = ["continuous"]
    with lineup_server("continuous", api_key=KEY, max_workloads=2) as url:
        assert httpx.get(f"{url}/v1/compare/modes", headers=AUTH).json()["max_workloads"] == 2
        target = f"{url}/v1/compare/workload"
        short = {"panes": pane, "requests": [_item(0, 2)]}
        with (
            httpx.stream("POST", target, json=_held(pane), headers=AUTH, timeout=120) as first,
            httpx.stream("POST", target, json=_held(pane), headers=AUTH, timeout=120) as second,
        ):
            assert (first.status_code, second.status_code) == (200, 200)
            streams = [_events(first), _events(second)]  # kept: a discarded line iterator closes the connection
            for events in streams:
                _first_answers(events, pane)  # both run
            refused = httpx.post(target, json=short, headers=AUTH)
            assert refused.status_code == 429, refused.text
            assert "at most 2 workloads at a time on this server" in refused.json()["error"]["message"]
        assert _all_finished(_run_when_free(url, short), pane, 1)
