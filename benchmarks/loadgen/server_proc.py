"""Start a server process on a free port, wait until /health says ready, stop it on exit."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx


class ServerStartError(RuntimeError):
    pass


@dataclass(frozen=True)
class LaunchConfig:
    argv: tuple[str, ...]  # "{host}" and "{port}" are filled in at launch
    host: str = "127.0.0.1"
    health_path: str = "/health"
    # Seconds without a new line in the server's log before a start counts as failed: a first batchserve start
    # (conversion, kernel build, format measurement) takes minutes, but logs progress every few seconds.
    health_timeout_s: float = 180.0
    max_start_s: float = 1800.0  # however much it logs, a start that takes longer has failed
    stop_grace_s: float = 15.0
    env: tuple[tuple[str, str], ...] = ()  # (name, value) pairs over this process's environment

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("argv must not be empty")
        if self.health_timeout_s <= 0 or self.stop_grace_s <= 0 or self.max_start_s <= 0:
            raise ValueError("health_timeout_s, max_start_s and stop_grace_s must be > 0")

    def command(self, port: int) -> list[str]:
        return [arg.replace("{host}", self.host).replace("{port}", str(port)) for arg in self.argv]


def free_port(host: str = "127.0.0.1") -> int:
    # The port could be taken between here and the server's bind; a clash shows up as a failed start.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """Context manager: `with ServerProcess(cfg, log) as server: server.base_url`."""

    def __init__(self, config: LaunchConfig, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.port = free_port(config.host)
        self.command = config.command(self.port)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int:
        """The server process's id (started: inside the `with`)."""
        assert self._proc is not None, "the server is not started"
        return self._proc.pid

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            # A new session keeps a Ctrl-C meant for the benchmark from reaching the server before we stop it.
            self._proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **dict(self.config.env)},
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _wait_healthy(self) -> None:
        """Until /health answers 200. The deadline moves on while the log grows (a slow first start that reports
        its progress is still starting), up to max_start_s in all."""
        assert self._proc is not None
        start = time.monotonic()
        deadline = start + self.config.health_timeout_s
        logged = self._log_size()
        url = self.base_url + self.config.health_path
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < min(deadline, start + self.config.max_start_s):
                if self._proc.poll() is not None:
                    raise ServerStartError(
                        f"server exited with code {self._proc.returncode} before it was healthy; "
                        f"log tail:\n{self.log_tail()}"
                    )
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                size = self._log_size()
                if size != logged:
                    logged, deadline = size, time.monotonic() + self.config.health_timeout_s
                time.sleep(0.5)
        raise ServerStartError(
            f"{url} not healthy after {time.monotonic() - start:.0f}s (its log silent for up to "
            f"{self.config.health_timeout_s:.0f}s, {self.config.max_start_s:.0f}s at most in all); "
            f"log tail:\n{self.log_tail()}"
        )

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after the grace period. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=self.config.stop_grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
