"""A server's peak memory scoring its longest prompt: docs/reliability.md, results/score-memory/."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.loadgen.proc_status import field_mb, status_fields
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.peers.targets import ServerSettings, batchserve_target
from benchmarks.results_io.report import write_json

TOP = 20  # the most alternatives the API allows


@dataclass(frozen=True)
class Rise:
    kind: str  # "plain" or "scored"
    rss_before_mb: float
    peak_rise_mb: float  # the largest over the repeats
    response_bytes: int


def memory_mb(pid: int) -> dict[str, float]:
    fields = status_fields(pid)
    return {name: field_mb(fields, name) for name in ("VmRSS", "VmHWM")}


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS


def body(prompt: list[int], scored: bool) -> dict[str, object]:
    extra: dict[str, object] = {"echo": True, "logprobs": TOP, "prompt_logprobs": TOP} if scored else {}
    return {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}


def measure(client: httpx.Client, pid: int, prompt: list[int], scored: bool, repeats: int) -> Rise:
    client.post("/v1/completions", json=body(prompt, scored)).raise_for_status()  # warm-up
    rises, size, before = [], 0, 0.0
    for _ in range(repeats):
        reset_peak(pid)
        before = memory_mb(pid)["VmRSS"]
        response = client.post("/v1/completions", json=body(prompt, scored))
        response.raise_for_status()
        size = len(response.content)
        rises.append(memory_mb(pid)["VmHWM"] - before)
    return Rise("scored" if scored else "plain", round(before, 1), round(max(rises), 1), size)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", default="continuous", choices=("dynamic", "continuous", "static"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here, the log beside it")
    args = parser.parse_args(argv)
    log = (args.out.parent if args.out else Path("/tmp")) / "score-memory.server.log"
    target = batchserve_target("score-memory", args.mode, ServerSettings())
    launch = target.launch(LaunchConfig(target.argv, health_timeout_s=300))
    with ServerProcess(launch, log) as server, httpx.Client(base_url=server.base_url, timeout=600) as client:
        max_model_len = int(client.get("/v1/models").json()["data"][0]["max_model_len"])
        prompt = [(17 * i) % 40000 + 100 for i in range(max_model_len - 1)]  # token ids, none special
        rises = [measure(client, server.pid, prompt, scored, args.repeats) for scored in (False, True)]
    result = {"mode": args.mode, "prompt_tokens": len(prompt), "top_logprobs": TOP, "rises": [asdict(r) for r in rises]}
    for rise in rises:
        print(
            f"{rise.kind:>6}: {len(prompt)}-token prompt, resident {rise.rss_before_mb:.0f} MB before, peak +"
            f"{rise.peak_rise_mb:.1f} MB; answer {rise.response_bytes / 1e6:.2f} MB"
        )
    if args.out:
        write_json(args.out, result)
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
