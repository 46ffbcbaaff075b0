"""The README's screenshot: `batchserve compare` on the real model, the hostage workload sent from the page.

    python -m benchmarks screenshot --out docs/img/compare.png
    python -m benchmarks screenshot --modes static,dynamic,continuous --width 1366 --out docs/img/compare-3.png

It starts `batchserve compare` (the default model unless --model), opens the page in Debian's headless Chromium
(`apt-get install -y chromium chromium-driver`), sends the workload from the page's control, waits until every
request has ended, freezes the lanes on the workload and saves the whole page as a PNG.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.loadgen.flags import add_seats_argument
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.page.driver import (
    INSTALL_HINT,
    PageWorkload,
    dropped_events,
    load_page,
    open_browser,
    pane_modes,
    pause,
    request_boxes,
    save_screenshot,
    send_workload,
    system_chromium,
    wait_workload_done,
)
from scheduler.lineup import DEFAULT, SYNTAX


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks screenshot", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/compare.png"))
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: the server's)")
    add_seats_argument(parser)
    parser.add_argument("--batch-timeout-ms", type=float, default=200.0)
    parser.add_argument("--modes", default=DEFAULT, help=f"batchserve compare --modes: {SYNTAX}")
    parser.add_argument("--batch-window-ms", type=float, default=None, help="static: the ticks' period")
    parser.add_argument("--workload", default="hostage", choices=("hostage", "mixed", "uniform"))
    parser.add_argument("--count", type=int, default=6, help="requests per mode")
    parser.add_argument("--short-tokens", type=int, default=24)
    parser.add_argument("--long-tokens", type=int, default=192)
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="ceiling for the server start and the run")
    parser.add_argument("--log", type=Path, default=Path("benchmarks/results/screenshot_server.log"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    chromium = system_chromium()
    if chromium is None:
        raise SystemExit(f"no system Chromium and chromedriver: {INSTALL_HINT}")
    command = [sys.executable, "-m", "api", "compare", "--host", "{host}", "--port", "{port}"]
    command += ["--seats", str(args.seats), "--batch-timeout-ms", str(args.batch_timeout_ms)]
    command += ["--modes", args.modes]
    if args.batch_window_ms is not None:
        command += ["--batch-window-ms", str(args.batch_window_ms)]
    if args.model:
        command += ["--model", args.model]
    workload = PageWorkload(args.workload, args.count, 0.0, args.short_tokens, args.long_tokens)
    with ServerProcess(LaunchConfig(tuple(command), health_timeout_s=args.timeout_s), args.log) as server:
        driver = open_browser(chromium, width=args.width)
        try:
            load_page(driver, server.base_url)
            send_workload(driver, workload)
            wait_workload_done(driver, args.timeout_s)
            pause(driver)
            path = save_screenshot(driver, args.out)
            if dropped_events(driver):
                print(f"warning: the page fell behind ({dropped_events(driver)} events dropped); run on a quieter CPU")
            for mode in pane_modes(driver):
                boxes = request_boxes(driver, mode)
                ends = sorted(box.finished_at_ms or 0.0 for box in boxes)
                print(f"{mode}: {len(boxes)} requests, ends (ms after the send): {[round(e) for e in ends]}")
        finally:
            driver.quit()
    print(f"saved {path}")
