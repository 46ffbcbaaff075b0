"""A server's memory with and without a flag: peak and current RSS (/proc's VmHWM, VmRSS) of `batchserve serve` once
it answers /health, and again after one prompt long enough to be a step past the row switch; then SIGTERM.

    python -m benchmarks.scripts.serve_rss [--serve-args "--dtype bfloat16 --quantization int4"]
                                           [--variants ",--int4-gemm all"] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.results_io.report import write_json


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def memory_mib(pid: int) -> dict[str, float]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {
        k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in lines) if k in ("VmHWM", "VmRSS")
    }


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def measure(serve_args: list[str], prompt_words: int) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "api", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                get(f"{base}/health")
                break
            except OSError:
                time.sleep(0.5)
        started = memory_mib(proc.pid)
        model = get(f"{base}/v1/models")["data"][0]["id"]
        body = {"model": model, "prompt": "The history of the city " * (prompt_words // 5), "max_tokens": 8}
        request = urllib.request.Request(
            f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            usage = json.load(response)["usage"]
        return {
            "serve_args": serve_args,
            "after_start_mib": started,
            "after_prompt_mib": memory_mib(proc.pid),
            "usage": usage,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-args", default="--dtype bfloat16 --quantization int4")
    parser.add_argument("--variants", default=",--int4-gemm all", help="comma-separated extra flags, one server each")
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    for variant in args.variants.split(","):
        results.append(measure(shlex.split(args.serve_args) + shlex.split(variant), args.prompt_words))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        write_json(args.out, {"command": " ".join(sys.argv[1:]), "results": results})


if __name__ == "__main__":
    main()
