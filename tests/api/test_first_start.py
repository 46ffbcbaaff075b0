"""A first start says what it is doing: `batchserve serve` on a GGUF with a fresh cache (a fresh HOME) logs each slow
phase in order (the conversion, the kernels, the format measurement with its candidates counted), each with its time,
where its result is cached and how to redo it (later starts reading those caches:
tests/engine/weights/test_loader.py and tests/api/runtime/test_format_probe.py). The tiny model stands in for
SmolLM2 (the same file layout, the same phases, in seconds); the kernel build is the one the session already made
(compiling it afresh takes minutes): its line is the cached build's."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from api.runtime.format_choice import read_entry
from engine.platform import native
from tests.server_harness import free_port
from tests.toolchain import CAN_BUILD_KERNELS

pytestmark = pytest.mark.slow  # a server process converting, building and measuring: tens of seconds

_READY = "batchserve ready on"


def start_until_ready(model: Path, home: Path) -> list[str]:
    """Run `batchserve serve --model MODEL` with HOME=`home` until it is ready, then stop it; its output's lines."""
    env = {key: value for key, value in os.environ.items() if key not in ("BATCHSERVE_CACHE_DIR", "XDG_CACHE_HOME")}
    build = native.best_build()
    env |= {"HOME": str(home), "TORCH_EXTENSIONS_DIR": str(native.build_directory(build).parent)}
    command = [sys.executable, "-m", "api", "serve", "--model", str(model), "--port", str(free_port())]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 300  # a stuck start fails here rather than hanging the suite
    try:
        while not any(_READY in line for line in seen):
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, "the server exited before it was ready:\n" + "\n".join(seen)
            seen.append(line)
    finally:
        process.terminate()
        process.wait(60)
    return seen


def assert_in_order(lines: Sequence[str], expected: Sequence[str | tuple[str, ...]]) -> None:
    """Each of `expected` (a text, or texts that share a line) is in a line after the previous one's."""
    at = 0
    for text in expected:
        parts = (text,) if isinstance(text, str) else text
        found = next((i for i in range(at, len(lines)) if all(part in lines[i] for part in parts)), None)
        assert found is not None, f"{text!r} not found after line {at}:\n" + "\n".join(lines)
        at = found + 1


def test_a_first_start_logs_its_phases_in_order_each_with_its_time_and_cache(tiny_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = start_until_ready(tiny_gguf, home)
    cache = home / ".cache" / "batchserve"
    (converted,) = cache.glob("tiny.Q4_1-*")
    # Cached, or kept as provisional where the tiny model's formats came out within the noise of each other.
    (choice_file,) = (cache / "format-choice").glob("*.json")
    entry = read_entry(choice_file)
    assert entry is not None
    provisional = f"provisional in {choice_file}: measured again"
    end = provisional if entry.choice.provisional else f"cached in {choice_file}; delete it to measure again"
    kernels = [f"the C++ kernels ({native.best_build().name}): done in "] if CAN_BUILD_KERNELS else []
    assert_in_order(
        first,
        [
            "loading torch and transformers, then the model",
            f"converting the GGUF into a float32 checkpoint, once per model file: {tiny_gguf}",
            ("converting the GGUF into a float32 checkpoint: done in ", f"cached in {converted}; delete it to convert"),
            *kernels,
            "measuring weight formats once for this CPU, 4 candidates (float32, bfloat16, int4/float32, int4/bfloat16)",
            "measuring weight formats once for this CPU: 1 of 4 (float32)",
            "measuring weight formats once for this CPU: 2 of 4 (bfloat16)",
            "measuring weight formats once for this CPU: 3 of 4 (int4/float32)",
            "measuring weight formats once for this CPU: 4 of 4 (int4/bfloat16)",
            "measuring weight formats once for this CPU: round 1 of ",
            "chosen by auto",
            ("measuring weight formats once for this CPU: done in ", end),
            "loading the weights: done in ",  # the chosen format only, once chosen
            "preparing the engine: done in ",
            _READY,
        ],
    )
    # The candidates' loads are quiet: the format kept is named by the choice, not by four lines that read as a loop.
    assert not [line for line in first if "quantised matmuls" in line]
