"""Drive the live page (`GET /`) in headless Chromium with Selenium: send a workload from its own control and read
what its panes show. Used by the browser test and by `python -m benchmarks screenshot`.

The browser is the operating system's (Debian: `apt-get install -y chromium chromium-driver`), never a download.
What the page shows is read from the stable ids and data attributes it sets for tools (api/live/static/app.js).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

INSTALL_HINT = "apt-get install -y chromium chromium-driver (as root)"


@dataclass(frozen=True)
class Chromium:
    browser: str
    driver: str


def system_chromium() -> Chromium | None:
    """Debian's chromium and its chromedriver, or None where either is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return Chromium(browser, driver) if browser and driver else None


def open_browser(chromium: Chromium, width: int = 1600, height: int = 1000) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = chromium.browser
    for argument in (
        "--headless=new",
        "--no-sandbox",  # as root in a container there is no user namespace for the sandbox
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(chromium.driver), options=options)


@dataclass(frozen=True)
class PageWorkload:
    """What to set in the page's send control."""

    kind: str = "hostage"  # hostage, mixed or uniform
    count: int = 6  # requests per mode
    rate: float = 0.0  # requests per second; 0: all at once
    short_tokens: int = 16
    long_tokens: int = 128
    exact_lengths: bool = True


@dataclass(frozen=True)
class RequestBox:
    """One request box of a pane: page times in ms since the send, server times in s on the server's clock."""

    mode: str
    kind: str
    request_id: str
    state: str
    finish_reason: str | None
    first_token_at_ms: float | None
    finished_at_ms: float | None
    server_queued_t: float | None
    server_finished_t: float | None
    server_released_t: float | None
    server_held_ms: float | None
    lane_bars: int | None  # bars of its request the lanes keep (None until it has an id)
    text: str


def _float(value: str | None) -> float | None:
    return None if value in (None, "") else float(value)  # type: ignore[arg-type]


def load_page(
    driver: WebDriver, base_url: str, api_key: str | None = None, timeout_s: float = 60.0, query: str = ""
) -> None:
    """Open the page (`query`: its address's, e.g. "keep_s=1"); give it the API key if it asks; wait until every
    pane's events flow."""
    driver.get(base_url + "/" + (f"?{query}" if query else ""))
    wait = WebDriverWait(driver, timeout_s, poll_frequency=0.1)
    wait.until(
        lambda d: d.execute_script(
            "return document.body.dataset.ready === 'true' || !document.getElementById('key-form').hidden"
        )
    )
    if not driver.find_element(By.ID, "key-form").get_attribute("hidden"):
        if api_key is None:
            raise RuntimeError("the page asks for an API key and none was given")
        driver.find_element(By.ID, "api-key").send_keys(api_key)
        driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    wait.until(lambda d: d.execute_script("return document.body.dataset.ready === 'true'"))
    wait.until(
        lambda d: d.execute_script(
            "const panes = [...document.querySelectorAll('section.pane')];"
            "return panes.length > 0 && panes.every((p) => p.dataset.live === 'true');"
        )
    )


def pane_modes(driver: WebDriver) -> list[str]:
    return list(driver.execute_script("return [...document.querySelectorAll('section.pane')].map(p => p.dataset.mode)"))


def send_workload(driver: WebDriver, workload: PageWorkload) -> None:
    """Fill in the send control and press its button, as a person would."""
    Select(driver.find_element(By.ID, "workload-kind")).select_by_value(workload.kind)
    for element_id, value in (
        ("workload-count", workload.count),
        ("workload-rate", workload.rate),
        ("workload-short", workload.short_tokens),
        ("workload-long", workload.long_tokens),
    ):
        field = driver.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(str(value))
    exact = driver.find_element(By.ID, "workload-ignore-eos")
    if exact.is_selected() != workload.exact_lengths:
        exact.click()
    driver.find_element(By.ID, "send").click()


def wait_workload_done(driver: WebDriver, timeout_s: float) -> None:
    """Every request the page sent has ended, and the event stream has told each box its release."""
    wait = WebDriverWait(driver, timeout_s, poll_frequency=0.2)
    wait.until(lambda d: d.execute_script("return document.body.dataset.workload === 'done'"))
    wait.until(
        lambda d: d.execute_script(
            "return [...document.querySelectorAll('li.request')]"
            ".every((b) => b.dataset.state !== 'done' || b.dataset.serverReleasedT)"
        )
    )


def request_boxes(driver: WebDriver, mode: str) -> list[RequestBox]:
    rows = driver.execute_script(
        "return [...document.querySelectorAll(`li.request[data-mode='${arguments[0]}']`)]"
        ".map((b) => ({...b.dataset, text: b.querySelector('.request-text').textContent}))",
        mode,
    )
    return [
        RequestBox(
            mode=row["mode"],
            kind=row["kind"],
            request_id=row.get("requestId", ""),
            state=row["state"],
            finish_reason=row.get("finishReason"),
            first_token_at_ms=_float(row.get("firstTokenAt")),
            finished_at_ms=_float(row.get("finishedAt")),
            server_queued_t=_float(row.get("serverQueuedT")),
            server_finished_t=_float(row.get("serverFinishedT")),
            server_released_t=_float(row.get("serverReleasedT")),
            server_held_ms=_float(row.get("serverHeldMs")),
            lane_bars=None if row.get("laneBars") in (None, "") else int(row["laneBars"]),
            text=row["text"],
        )
        for row in rows
    ]


def figure(driver: WebDriver, name: str, mode: str) -> str:
    """A pane's figure by name: waiting, running, held-now, tokens-per-s, ttft-p50, ttft-p99, held-seat-steps."""
    return str(driver.execute_script("return document.getElementById(arguments[0]).textContent", f"{name}-{mode}"))


def wait_for_figure(driver: WebDriver, name: str, mode: str, value: str, timeout_s: float) -> None:
    """Figures are refreshed a few times a second: wait until one shows `value`."""
    WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda d: figure(d, name, mode) == value)


def drawn_bars(driver: WebDriver, mode: str, phase: str) -> int:
    """Bars of a phase (prefill, decode, held, idle) the pane's lanes show in their current time window."""
    attribute = "drawn" + phase.capitalize()
    value = driver.execute_script(
        "return document.getElementById(arguments[0]).dataset[arguments[1]]", f"lanes-{mode}", attribute
    )
    return int(value or 0)


def kept(driver: WebDriver, mode: str, what: str) -> int:
    """What a pane's lanes keep, as of the page's last prune: "bars", or "requests" (distinct ids with bars)."""
    attribute = "kept" + what.capitalize()
    value = driver.execute_script(
        "return document.getElementById(arguments[0]).dataset[arguments[1]]", f"lanes-{mode}", attribute
    )
    return int(value or 0)


def body_time(driver: WebDriver, name: str) -> float | None:
    """A server time the page states on <body> (keptSinceT, runKeptFromT, runKeptUntilT), or None if unset."""
    return _float(driver.execute_script("return document.body.dataset[arguments[0]]", name))


def pause(driver: WebDriver) -> None:
    """Freeze the lanes (the page keeps receiving events), e.g. before reading them or taking a screenshot."""
    checkbox = driver.find_element(By.ID, "pause")
    if not checkbox.is_selected():
        checkbox.click()


def dropped_events(driver: WebDriver) -> int:
    """Events the server dropped because the page fell behind (its lanes then have a gap)."""
    return int(driver.execute_script("return Number(document.body.dataset.droppedEvents || 0)"))


def browser_errors(driver: webdriver.Chrome) -> list[str]:
    """The page's console errors (uncaught exceptions, failed loads) since the last call."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def save_screenshot(driver: WebDriver, path: Path) -> Path:
    """The whole page, not only the window: the window grows to the page's height first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    width = int(driver.execute_script("return document.documentElement.clientWidth"))
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(max(width, 800), min(max(height + 120, 600), 4000))
    driver.execute_script("window.scrollTo(0, 0)")
    # Two animation frames: the lanes are redrawn at the new size before the picture is taken.
    driver.execute_async_script(
        "const done = arguments[0]; requestAnimationFrame(() => requestAnimationFrame(() => done()));"
    )
    driver.save_screenshot(str(path))
    return path
