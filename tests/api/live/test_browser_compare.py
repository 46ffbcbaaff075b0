"""The live page in a real browser: Debian's headless Chromium, driven by Selenium through the system chromedriver,
against a live `batchserve compare` (and a plain `batchserve serve`) on the tiny model.

The hostage workload is sent from the page's own control. What the page shows is then read back: every request's
box ends in both panes; in the dynamic pane the short answers are held (its lanes show held seats, its counter
counts them) and end with the long one; in the continuous pane nothing is held and the short answers end first.
Ordering is read from the server times the page shows (the event stream's), never from how long anything took.
With `--modes static,dynamic,continuous` the page has three panes side by side on a laptop-wide window, and the
static pane holds its short answers as the bus does, and the "held" legend and each pane's held seat-steps show
without scrolling. With a short `?keep_s` the page is shown to keep the last workload's whole run (the old rule,
the last keep_s seconds only, would have dropped it) and to drop what lies outside it.

Needs `apt-get install -y chromium chromium-driver` (root); without them the tests skip and say so.
BATCHSERVE_SCREENSHOT=<path> also saves the compare screenshot there (the pytest tmp dir always has one).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.support.ui import WebDriverWait

from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.page.driver import (
    INSTALL_HINT,
    PageWorkload,
    RequestBox,
    body_time,
    browser_errors,
    drawn_bars,
    figure,
    kept,
    load_page,
    open_browser,
    pane_modes,
    pause,
    request_boxes,
    save_screenshot,
    send_workload,
    system_chromium,
    wait_for_figure,
    wait_workload_done,
)
from tests.server_harness import mode_config, running_server

CHROMIUM = system_chromium()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason=f"no system Chromium and chromedriver: {INSTALL_HINT}"),
]

API_KEY = "page-test-key"
# One long answer among short ones. The long one is many times longer, so in continuous mode the short ones end
# long before it, whatever the machine's speed.
HOSTAGE = PageWorkload(kind="hostage", count=6, short_tokens=8, long_tokens=96)
# As many seats as requests and a batch timeout that never fires first: the dynamic bus leaves when all six are
# queued, so they share one batch however slowly the page's two requests (the long, the short ones) arrive.
SEATS = HOSTAGE.count
BATCH_TIMEOUT_MS = 600_000
WAIT_S = 300.0  # a ceiling for a loaded 2-core machine, not a speed requirement
THREE_PANES = PageWorkload(kind="hostage", count=4, short_tokens=4, long_tokens=32)  # short: three servers' worth
LAPTOP = (1280, 800)  # a common laptop screen, in CSS pixels
KEEP_S = 1  # the page's ?keep_s for the history test: what lies outside the last workload's run goes after 1 s


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    assert CHROMIUM is not None
    driver = open_browser(CHROMIUM)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def compare_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`batchserve compare` as a user starts it, with an API key, so the page must ask for it."""
    argv = (
        sys.executable, "-m", "api", "compare", "--model", str(tiny_checkpoint), "--host", "{host}",
        "--port", "{port}", "--seats", str(SEATS), "--batch-timeout-ms", str(BATCH_TIMEOUT_MS), "--api-key", API_KEY,
        "--no-cpu-kernels",  # plain torch ops: no C++ build to wait for; the page is what is tested here
    )  # fmt: skip
    log = tmp_path_factory.mktemp("compare") / "server.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # the server's; the browser and this test need the other core
        with ServerProcess(LaunchConfig(argv, health_timeout_s=WAIT_S), log) as server:
            yield server.base_url


@pytest.fixture(scope="module")
def three_mode_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`batchserve compare --modes static,dynamic,continuous`. Neither the static clock (a tick every 10 min from the
    start) nor the bus's timeout fires during the test: both batches leave when full, with all four requests."""
    argv = (
        sys.executable, "-m", "api", "compare", "--modes", "static,dynamic,continuous", "--model",
        str(tiny_checkpoint), "--host", "{host}", "--port", "{port}", "--seats", str(THREE_PANES.count),
        "--batch-timeout-ms", str(BATCH_TIMEOUT_MS), "--batch-window-ms", str(BATCH_TIMEOUT_MS), "--no-cpu-kernels",
    )  # fmt: skip
    log = tmp_path_factory.mktemp("compare3") / "server.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with ServerProcess(LaunchConfig(argv, health_timeout_s=WAIT_S), log) as server:
            yield server.base_url


def _one(boxes: list[RequestBox], kind: str) -> RequestBox:
    (box,) = [b for b in boxes if b.kind == kind]
    return box


def _server_times(box: RequestBox) -> tuple[float, float]:
    """When the box's request finished and when it was released, as the page learnt from the event stream."""
    assert box.server_finished_t is not None and box.server_released_t is not None, box
    return box.server_finished_t, box.server_released_t


def _assert_all_finished(boxes: list[RequestBox], count: int, kinds: set[str]) -> None:
    assert len(boxes) == count
    for box in boxes:
        assert box.state == "done", box
        assert box.finish_reason == "length", box  # exact lengths: every answer ran to its max_tokens
        assert box.request_id.startswith("cmpl-"), box
        assert box.text, box  # its text streamed into its box
        finished, released = _server_times(box)
        assert finished <= released
    assert {b.kind for b in boxes} == kinds


def test_compare_page_shows_the_hostage_case_held_in_dynamic_mode_and_not_in_continuous(
    browser, compare_server: str, tmp_path: Path
) -> None:
    load_page(browser, compare_server, api_key=API_KEY)
    assert pane_modes(browser) == ["dynamic", "continuous"]
    assert browser.execute_script("return sessionStorage.getItem('batchserve.apiKey')") == API_KEY
    refusals = browser_errors(browser)  # the page asked for the key because the server refused it without one
    assert refusals and all("/v1/compare/modes" in e and "401" in e for e in refusals), refusals

    send_workload(browser, HOSTAGE)
    wait_workload_done(browser, WAIT_S)
    pause(browser)  # the lanes stay on this workload while they are read and photographed

    dynamic = request_boxes(browser, "dynamic")
    continuous = request_boxes(browser, "continuous")
    _assert_all_finished(dynamic, HOSTAGE.count, {"long", "short"})
    _assert_all_finished(continuous, HOSTAGE.count, {"long", "short"})
    for mode in ("dynamic", "continuous"):
        wait_for_figure(browser, "finished", mode, str(HOSTAGE.count), WAIT_S)

    # Dynamic: the short answers finished first but were held, and released with the long one.
    long_finished, _ = _server_times(_one(dynamic, "long"))
    for box in (b for b in dynamic if b.kind == "short"):
        finished, released = _server_times(box)
        assert finished < long_finished <= released, box
        assert box.server_held_ms is not None and box.server_held_ms > 0, box
    assert int(figure(browser, "held-seat-steps", "dynamic")) > 0
    assert drawn_bars(browser, "dynamic", "held") > 0

    # Continuous: nothing held; every short answer was released, and reached the page, before the long one ended.
    long_answer = _one(continuous, "long")
    long_finished, _ = _server_times(long_answer)
    assert long_answer.finished_at_ms is not None
    for box in (b for b in continuous if b.kind == "short"):
        _, released = _server_times(box)
        assert released < long_finished, box
        assert box.finished_at_ms is not None and box.finished_at_ms < long_answer.finished_at_ms, box
        assert not box.server_held_ms, box
    assert figure(browser, "held-seat-steps", "continuous") == "0"
    assert drawn_bars(browser, "continuous", "held") == 0
    for mode in ("dynamic", "continuous"):
        assert drawn_bars(browser, mode, "decode") > 0 and drawn_bars(browser, mode, "prefill") > 0

    shot = save_screenshot(browser, tmp_path / "compare.png")
    assert shot.stat().st_size > 10_000
    if os.environ.get("BATCHSERVE_SCREENSHOT"):
        save_screenshot(browser, Path(os.environ["BATCHSERVE_SCREENSHOT"]))
    assert browser_errors(browser) == []


def _assert_short_answers_held_until_the_long_one_ends(browser: object, boxes: list[RequestBox], mode: str) -> None:
    long_finished, _ = _server_times(_one(boxes, "long"))
    for box in (b for b in boxes if b.kind == "short"):
        finished, released = _server_times(box)
        assert finished < long_finished <= released, box
        assert box.server_held_ms is not None and box.server_held_ms > 0, box
    assert int(figure(browser, "held-seat-steps", mode)) > 0
    assert drawn_bars(browser, mode, "held") > 0


def _assert_on_screen(browser: object, element_id: str, one_line: bool = False) -> None:
    """Shown, inside the window as it opened (not scrolled), and, if `one_line`, no taller than one line of text."""
    assert browser.find_element("id", element_id).is_displayed(), element_id  # type: ignore[attr-defined]
    box = browser.execute_script(  # type: ignore[attr-defined]
        "const e = document.getElementById(arguments[0]);"
        "return {...e.getBoundingClientRect().toJSON(), line: parseFloat(getComputedStyle(e).lineHeight),"
        " width: innerWidth, height: innerHeight, scrolled: scrollY};",
        element_id,
    )
    assert box["scrolled"] == 0 and box["top"] >= 0 and box["left"] >= 0, box
    assert box["bottom"] <= box["height"] and box["right"] <= box["width"], (element_id, box)
    if one_line:
        assert box["bottom"] - box["top"] < 2 * box["line"], (element_id, box)


def _assert_short_answers_reached_the_queue_at_once_and_ended_first(panes: dict[str, list[RequestBox]]) -> None:
    """Continuous's short answers arrived with the workload's start (the first arrival in any pane, on the server's
    clock; a second's slack for a loaded machine, far less than the long answer takes) and were released before
    the long one finished."""
    arrivals = [box.server_queued_t for boxes in panes.values() for box in boxes]
    assert all(t is not None for t in arrivals), panes
    start = min(t for t in arrivals if t is not None)
    long_finished, _ = _server_times(_one(panes["continuous"], "long"))
    for box in (b for b in panes["continuous"] if b.kind == "short"):
        assert box.server_queued_t is not None and box.server_queued_t - start < 1.0, (start, box)
        _, released = _server_times(box)
        assert released < long_finished, box


def test_three_panes_side_by_side_each_show_their_requests_finishing(browser, three_mode_server: str) -> None:
    browser.set_window_size(*LAPTOP)
    try:
        load_page(browser, three_mode_server)
        modes = ["static", "dynamic", "continuous"]
        assert pane_modes(browser) == modes
        # Side by side on the laptop-wide window: one row, each pane about a third of it, its figures shown.
        boxes = browser.execute_script(
            "return [...document.querySelectorAll('section.pane')].map((p) => p.getBoundingClientRect().toJSON())"
        )
        assert len({round(b["top"]) for b in boxes}) == 1, boxes
        assert all(300 < b["width"] < LAPTOP[0] / 3 for b in boxes), boxes
        for mode in modes:
            assert browser.find_element("id", f"finished-{mode}").is_displayed()
        detail = browser.find_element("css selector", "#pane-static .pane-detail").text
        assert f"a tick every {BATCH_TIMEOUT_MS} ms" in detail and "4 seats" in detail

        send_workload(browser, THREE_PANES)
        wait_workload_done(browser, WAIT_S)
        pause(browser)
        panes = {mode: request_boxes(browser, mode) for mode in modes}
        for mode in modes:
            _assert_all_finished(panes[mode], THREE_PANES.count, {"long", "short"})
            wait_for_figure(browser, "finished", mode, str(THREE_PANES.count), WAIT_S)
            assert drawn_bars(browser, mode, "decode") > 0 and drawn_bars(browser, mode, "prefill") > 0
        # Static and dynamic run the batch as one unit: the short answers wait for the long one.
        for mode in ("static", "dynamic"):
            _assert_short_answers_held_until_the_long_one_ends(browser, panes[mode], mode)
        # Continuous holds nothing, and its short answers end before its long one: the server started every pane's
        # requests together (one workload request from the page), so none waited for a browser connection.
        assert all(not box.server_held_ms for box in panes["continuous"])
        assert figure(browser, "held-seat-steps", "continuous") == "0"
        assert drawn_bars(browser, "continuous", "held") == 0
        _assert_short_answers_reached_the_queue_at_once_and_ended_first(panes)
        assert browser.find_element("id", "workload-note").text == f"done: {THREE_PANES.count} requests per mode"
        # What "held" means, in one line by the lanes, and every pane's held seat-steps: on screen without scrolling.
        _assert_on_screen(browser, "held-legend", one_line=True)
        for mode in modes:
            _assert_on_screen(browser, f"held-seat-steps-{mode}")
        assert browser_errors(browser) == []
    finally:
        browser.set_window_size(1600, 1000)


def _wait_past(browser: object, t: float) -> None:
    """Until the page's keep horizon (its now minus keep_s, stated on <body>) is past server time `t`: by then the
    old rule, keep the last keep_s seconds and nothing more, has dropped every bar that ended before `t`."""
    WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(lambda d: (body_time(d, "keptSinceT") or 0) > t)


def test_compare_page_keeps_the_last_workloads_whole_run_and_drops_what_lies_outside_it(
    browser, compare_server: str
) -> None:
    """With ?keep_s=1, the hostage workload's lanes are all still there once the page's clock is past the run's end
    plus keep_s (the continuous pane's early short answers too), so a run longer than the old 180 s keeps its start.
    A request from outside the page after the run goes after keep_s, and the next workload's start lets the
    first run's bars go: what the lanes hold stays bounded."""
    load_page(browser, compare_server, api_key=API_KEY, query=f"keep_s={KEEP_S}")
    assert browser.execute_script("return document.body.dataset.keepS") == str(KEEP_S)
    send_workload(browser, HOSTAGE)
    wait_workload_done(browser, WAIT_S)
    modes = ("dynamic", "continuous")
    first_run = {mode: request_boxes(browser, mode) for mode in modes}
    # The run's kept stretch ends once the workload has (stated at the page's next refresh, a few times a second).
    WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(lambda d: body_time(d, "runKeptUntilT") is not None)
    run_until = body_time(browser, "runKeptUntilT")
    assert run_until is not None
    last_release = max(_server_times(box)[1] for boxes in first_run.values() for box in boxes)
    _wait_past(browser, max(run_until, last_release))

    for mode in modes:
        boxes = request_boxes(browser, mode)
        assert len(boxes) == HOSTAGE.count
        assert all(box.lane_bars for box in boxes), boxes  # every request's bars, the first to end too
        assert kept(browser, mode, "requests") == HOSTAGE.count
        drawn = int(
            browser.execute_script(
                "return document.getElementById(arguments[0]).dataset.drawnRequests", f"lanes-{mode}"
            )
        )
        assert drawn == HOSTAGE.count  # "fit the last workload" shows them all
    assert drawn_bars(browser, "dynamic", "held") > 0

    # A request from elsewhere after the run: shown, then gone keep_s later, as it lies outside the run.
    answer = httpx.post(
        compare_server + "/continuous/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0},
        timeout=WAIT_S,
    )
    assert answer.status_code == 200, answer.text
    wait_for_figure(browser, "finished", "continuous", str(HOSTAGE.count + 1), WAIT_S)
    WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(
        lambda d: kept(d, "continuous", "requests") == HOSTAGE.count
    )

    # The next workload starts: the first run is no longer kept, the new one is. As many as the seats, so the
    # dynamic bus leaves full (its timeout never fires here).
    send_workload(browser, PageWorkload(kind="uniform", count=SEATS, short_tokens=2, long_tokens=2))
    wait_workload_done(browser, WAIT_S)
    for mode in modes:
        first_ids = {box.request_id for box in first_run[mode]}
        WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(
            lambda d, mode=mode, first_ids=first_ids: all(
                box.lane_bars for box in request_boxes(d, mode) if box.request_id not in first_ids
            )
        )
        boxes = request_boxes(browser, mode)
        assert len(boxes) == HOSTAGE.count + SEATS
        assert all(box.lane_bars for box in boxes if box.request_id not in first_ids), boxes
        assert all(box.lane_bars == 0 for box in boxes if box.request_id in first_ids), boxes
    assert browser_errors(browser) == []


# The widest run of canvas pixels in the cached band's colour (--cached, #56b4e9), per pixel row, in CSS pixels.
_CACHED_BAND_WIDTH_JS = """
const canvas = document.getElementById(arguments[0]);
const { width, height } = canvas;
const pixels = canvas.getContext("2d").getImageData(0, 0, width, height).data;
const target = [0x56, 0xb4, 0xe9];
let widest = 0;
for (let y = 0; y < height; y += 1) {
  let run = 0;
  for (let x = 0; x < width; x += 1) {
    const i = (y * width + x) * 4;
    const near = target.every((value, c) => Math.abs(pixels[i + c] - value) <= 16);
    run = near ? run + 1 : 0;
    if (run > widest) widest = run;
  }
}
return widest / (window.devicePixelRatio || 1);
"""


def test_compare_page_shows_the_cached_share_of_a_re_sent_prompt(browser, compare_server: str, tmp_path: Path) -> None:
    """The same six prompts sent twice: the second time each finds its prompt's full blocks in its mode's prefix
    cache (the event stream's `admitted` carries cached_tokens), and in each pane the prefill bars of that workload
    carry the cached band: counted by the lanes (data-drawn-cached) and there on the canvas, in the band's colour."""
    load_page(browser, compare_server, api_key=API_KEY)
    earlier = browser_errors(browser)  # only the refusal that made the page ask for its key, if this tab had none
    assert all("/v1/compare/modes" in e and "401" in e for e in earlier), earlier
    # Six short prompts of 18-33 tokens each (at least one full 16-token block), two tokens of answer: the window
    # that fits the last workload is mostly its prefill step, so the band is wide.
    again = PageWorkload(kind="uniform", count=SEATS, short_tokens=2, long_tokens=2)
    send_workload(browser, again)
    wait_workload_done(browser, WAIT_S)
    # The page takes one workload a second at most, and says so: press send until it takes the second.
    WebDriverWait(browser, WAIT_S, poll_frequency=0.25).until(
        lambda d: send_workload(d, again) or "a second at most" not in d.find_element("id", "workload-note").text
    )
    wait_workload_done(browser, WAIT_S)
    for mode in ("dynamic", "continuous"):
        _assert_all_finished(request_boxes(browser, mode), 2 * SEATS, {"uniform"})  # both workloads' boxes
        # every prefill of the re-sent workload read its prompt's first block(s) from the cache
        WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(
            lambda d, mode=mode: drawn_bars(d, mode, "cached") >= SEATS
        )
    pause(browser)
    for mode in ("dynamic", "continuous"):
        assert drawn_bars(browser, mode, "cached") >= SEATS
        width = browser.execute_script(_CACHED_BAND_WIDTH_JS, f"lanes-{mode}")
        assert width >= 2, f"{mode}: no band in the cached colour on the lanes"
    save_screenshot(browser, tmp_path / "cached.png")
    assert browser_errors(browser) == []


def test_compare_page_refuses_more_requests_than_max_prompts(browser, compare_server: str) -> None:
    load_page(browser, compare_server, api_key=API_KEY)  # the key is in this tab's sessionStorage now
    limit = int(browser.execute_script("return Number(document.getElementById('workload-count').max)"))
    assert limit == 32  # the server's --max-prompts default, from GET /v1/compare/modes
    send_workload(browser, PageWorkload(kind="uniform", count=limit + 1))
    assert "must be 1 to 32" in browser.find_element("id", "workload-note").text
    assert request_boxes(browser, "dynamic") == request_boxes(browser, "continuous") == []


def test_serve_page_shows_its_one_mode(browser, one_torch_thread: None) -> None:
    with running_server(mode_config("continuous", cpu_kernels=False)) as server:
        load_page(browser, server.base_url)
        assert pane_modes(browser) == ["continuous"]
        send_workload(browser, PageWorkload(kind="mixed", count=4, short_tokens=4, long_tokens=12))
        wait_workload_done(browser, WAIT_S)
        boxes = request_boxes(browser, "continuous")
        _assert_all_finished(boxes, 4, {"long", "short"})
        wait_for_figure(browser, "finished", "continuous", "4", WAIT_S)
        assert browser_errors(browser) == []


def test_a_speculating_pane_shows_accepted_tokens_per_step(browser, one_torch_thread: None) -> None:
    spec = (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
        '"draft_length": "fixed"}'
    )
    with running_server(mode_config("continuous", cpu_kernels=False, speculative_config=spec)) as server:
        load_page(browser, server.base_url)
        send_workload(browser, PageWorkload(kind="mixed", count=4, short_tokens=8, long_tokens=24))
        wait_workload_done(browser, WAIT_S)
        wait_for_figure(browser, "finished", "continuous", "4", WAIT_S)
        metrics = httpx.get(f"{server.base_url}/metrics").text
        accepted = sum(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode_num_accepted_tokens_total{")
        )
        assert accepted > 0  # the tiny model repeats itself: its own tokens make drafts it accepts
        shown = browser.execute_script("return document.getElementById('accepted-per-step-continuous').dataset.value")
        assert float(shown) == accepted  # the page summed every step's accepted tokens
        assert float(figure(browser, "accepted-per-step", "continuous")) > 0
        assert browser_errors(browser) == []
