"""ServerProcess's wait for /health: a start that keeps logging (a first start's phases) is waited for past
health_timeout_s, a silent one fails after it, and max_start_s caps both. The servers are real processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess, ServerStartError

# argv[1]: seconds of progress lines (one each 0.1 s) before serving; "forever" logs without end; "silent" sleeps.
_SERVER = """
import http.server, sys, time
how = sys.argv[1]
if how == "silent":
    time.sleep(600)
until = float("inf") if how == "forever" else time.monotonic() + float(how)
while time.monotonic() < until:
    print("still starting", flush=True)
    time.sleep(0.1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Health).serve_forever()
"""


def _launch(how: str, **limits: float) -> LaunchConfig:
    return LaunchConfig((sys.executable, "-c", _SERVER, how, "{port}"), stop_grace_s=2.0, **limits)


@pytest.mark.slow  # a process that waits out its timeouts: 1 to 2.5 s by design
def test_a_start_that_keeps_logging_is_waited_for_past_the_silence_timeout(tmp_path: Path) -> None:
    with ServerProcess(_launch("2.5", health_timeout_s=1.0), tmp_path / "log") as server:
        assert "still starting" in server.log_tail()


@pytest.mark.slow  # a process that waits out its timeouts: 1 to 2.5 s by design
def test_a_silent_start_fails_after_the_timeout_naming_it(tmp_path: Path) -> None:
    server = ServerProcess(_launch("silent", health_timeout_s=1.0), tmp_path / "log")
    with pytest.raises(ServerStartError, match="silent for up to 1s"), server:
        pass


@pytest.mark.slow  # a process that waits out its timeouts: 1 to 2.5 s by design
def test_max_start_s_caps_a_start_that_logs_for_ever(tmp_path: Path) -> None:
    server = ServerProcess(_launch("forever", health_timeout_s=1.0, max_start_s=2.0), tmp_path / "log")
    with pytest.raises(ServerStartError, match="2s at most in all") as caught, server:
        pass
    assert "still starting" in str(caught.value)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_start_s"):
        _launch("1", max_start_s=0)
