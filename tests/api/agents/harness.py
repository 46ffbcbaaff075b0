"""A live real-model server whose every HTTP exchange is recorded, and the runner of the agent-client programs
(clients/) against it. The programs run as subprocesses of this interpreter, as a user's program would: they
import neither batchserve nor the suite, and a library's global state (tracing, caches) stays in its process."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.apps.serve import create_app
from benchmarks.loadgen.server_proc import free_port
from tests.server_harness import mode_config, real_loaded_model, serving_app, shared_compile_workers

HERE = Path(__file__).resolve().parent
# The libraries the programs import (module names); the test extra installs them (pyproject.toml).
CLIENT_MODULES = (
    "agents",
    "anthropic",
    "langgraph",
    "langchain_openai",
    "pydantic_ai",
    "litellm",
    "openai",
    "jsonschema",
)
# A guard against a hung client, not a speed check: a program's scenarios take seconds to a few minutes.
PROGRAM_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Exchange:
    method: str
    path: str
    status: int


@dataclass
class StatusRecorder:
    """ASGI middleware, outermost: records the status of every response the server sends, whatever answered."""

    app: Any
    exchanges: list[Exchange] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def recording_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.exchanges.append(Exchange(scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, recording_send)


@dataclass(frozen=True)
class RecordedServer:
    base_url: str
    model: str
    recorder: StatusRecorder


@contextlib.contextmanager
def recorded_server(mode: str) -> Iterator[RecordedServer]:
    """The default model (SmolLM2-135M-Instruct) served in `mode` on a free port, every exchange recorded."""
    config = mode_config(mode, port=free_port())
    loaded = real_loaded_model()
    recorder = StatusRecorder(
        create_app(config, loader=lambda _config: loaded, compile_workers=shared_compile_workers())
    )
    with serving_app(recorder, config) as (base_url, _server):
        model = str(httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"])
        yield RecordedServer(base_url, model, recorder)


def require_client_libraries() -> None:
    """Skip when a client library is missing from this environment (a venv made before the test extra listed
    them); in CI (`CI` set, as CI services do) fail instead, so a broken install cannot pass as skips."""
    missing = [name for name in CLIENT_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    reason = f"agent client libraries not installed ({', '.join(missing)}): pip install -e '.[test]'"
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass(frozen=True)
class ClientRun:
    program: str
    returncode: int
    stdout: str
    stderr: str
    exchanges: tuple[Exchange, ...]

    def scenarios(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    def problems(self, expected_paths: set[str]) -> list[str]:
        """Everything wrong with the run: failed scenarios, a crash, a non-200 status, an endpoint never used."""
        problems = [f"{line['scenario']}: {line['error']}" for line in self.scenarios() if not line["ok"]]
        if self.returncode != 0 and not problems:
            problems.append(f"exited {self.returncode} with no failed scenario: {self.stderr[-3000:]}")
        problems += [f"HTTP {e.status} for {e.method} {e.path}" for e in self.exchanges if e.status != 200]
        used = {exchange.path for exchange in self.exchanges}
        problems += [f"never requested {path}" for path in sorted(expected_paths - used)]
        return problems


def run_client(server: RecordedServer, program: str) -> ClientRun:
    """Run clients/`program`.py against `server`, with what the server recorded while it ran."""
    env = {
        **os.environ,
        "NO_PROXY": "127.0.0.1,localhost",  # a CI proxy must not see loopback traffic
        "no_proxy": "127.0.0.1,localhost",
        "LANGSMITH_TRACING": "false",
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    start = len(server.recorder.exchanges)
    done = subprocess.run(
        [sys.executable, "-m", f"clients.{program}", server.base_url, server.model],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=PROGRAM_TIMEOUT_S,
        check=False,
    )
    exchanges = tuple(server.recorder.exchanges[start:])
    return ClientRun(program, done.returncode, done.stdout, done.stderr, exchanges)
