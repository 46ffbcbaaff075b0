"""What Ray Serve's proxy costs: the plain server against 1 replica (2 threads) and 2 replicas (1 thread each)
behind the proxy, in both batching modes, at light load (TTFT p50) and at saturation (output throughput).

    python -m benchmarks ray --out benchmarks/results/scale-out --num-prompts 48 --light-prompts 24

Each server is started on a free port (`python -m api serve`, or `python -m api.scale_out.ray_serve --replicas N` with
its own local Ray instance), waited on until /health is 200, measured, and stopped before the next one starts.
`--rounds N` runs the setups in turn N times (plain, proxy, plain, proxy, ...): each proxy run is compared with
the plain run of its own round, and the verdict takes the median over rounds, since this machine's speed drifts
by more than the targets within minutes. On
a 2-core machine two replicas cannot be faster than one: the point is the proxy's overhead, not a speed-up.
Targets for the proxy, 1 replica against the plain server: TTFT p50 at light load at most 15 ms higher,
saturated throughput at least 0.9x.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.loadgen.arrivals import ArrivalConfig
from benchmarks.loadgen.client import ClientConfig, EosPolicy, discover_model
from benchmarks.loadgen.flags import add_seats_argument
from benchmarks.loadgen.run import RunConfig, RunResult, run_benchmark
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess, ServerStartError
from benchmarks.loadgen.workloads import WorkloadConfig, build_workload
from benchmarks.results_io.report import write_json
from benchmarks.results_io.tables import format_run

MODES = ("dynamic", "continuous")
TTFT_BUDGET_MS = 15.0  # the proxy's TTFT p50 cost at light load, 1 replica vs the plain server
THROUGHPUT_FLOOR = 0.9  # its saturated throughput, as a share of the plain server's


@dataclass(frozen=True)
class Setup:
    """One way to serve: the plain server, or N replicas behind Ray Serve's proxy with T threads each."""

    name: str
    replicas: int  # 0: the plain server, no Ray
    threads: int

    def argv(self, mode: str, seats: int, model: str | None) -> tuple[str, ...]:
        if self.replicas == 0:
            argv = [sys.executable, "-m", "api", "serve"]
        else:
            argv = [sys.executable, "-m", "api.scale_out.ray_serve", "--replicas", str(self.replicas)]
            argv += ["--cpus-per-replica", str(self.threads)]
        argv += ["--mode", mode, "--host", "{host}", "--port", "{port}"]
        argv += ["--max-batch-size", str(seats), "--max-num-seqs", str(seats)]
        return (*argv, *(["--model", model] if model else []))

    @property
    def baseline(self) -> str:
        """The plain setup with this setup's threads per server: what the proxy is compared with."""
        return "plain" if self.threads == 2 else f"plain-{self.threads}"


# Threads: the plain server's through OMP_NUM_THREADS, each replica's through --cpus-per-replica. The issue's three
# setups are the default; `plain-1` and `proxy-1x1` leave a core free for Ray's own processes, which separates the
# proxy path's cost from their contention with a replica that wants both cores.
SETUPS = (
    Setup("plain", 0, 2),
    Setup("proxy-1x2", 1, 2),
    Setup("proxy-2x1", 2, 1),
    Setup("plain-1", 0, 1),
    Setup("proxy-1x1", 1, 1),
)
DEFAULT_SETUPS = ("plain", "proxy-1x2", "proxy-2x1")


@dataclass(frozen=True)
class Measured:
    setup: str
    mode: str
    command: str
    light: RunResult | None
    saturated: RunResult | None
    error: str | None = None
    round: int = 0

    def ttft_p50_ms(self) -> float | None:
        dist = self.light.summary.ttft_ms if self.light is not None else None
        return None if dist is None else dist.p50

    def throughput(self) -> float | None:
        return None if self.saturated is None else self.saturated.summary.output_throughput


def _run_config(label: str, url: str, model: str | None, rate: float, args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        label=label,
        client=ClientConfig(
            base_url=url,
            model=model,
            seed=args.seed,
            eos_policy=EosPolicy.IGNORE_EOS,
            request_timeout_s=args.request_timeout,
            show_progress=not args.no_progress,
            progress_label=label,
        ),
        arrivals=ArrivalConfig(request_rate=rate, seed=args.seed),
        warmup_requests=2,
    )


def measure(setup: Setup, mode: str, args: argparse.Namespace, log_dir: Path, round_: int = 0) -> Measured:
    argv = setup.argv(mode, args.seats, args.model)
    # The server inherits this environment: the plain server's torch threads come from it (a replica sets its own
    # from --cpus-per-replica), so a caller's OMP_NUM_THREADS=1 cannot skew the comparison.
    os.environ["OMP_NUM_THREADS"] = str(setup.threads)
    launch = LaunchConfig(argv=argv, health_timeout_s=args.health_timeout, stop_grace_s=60.0)
    suffix = f"-round{round_}" if round_ else ""
    server = ServerProcess(launch, log_dir / f"{setup.name}-{mode}{suffix}.server.log")
    command = shlex.join(server.command)
    light = saturated = None
    try:
        with server:
            model = asyncio.run(discover_model(server.base_url))
            light_specs = build_workload(WorkloadConfig("mixed", args.light_prompts, args.seed))
            label = f"{setup.name}/{mode}"
            light_config = _run_config(f"{label}@{args.light_rate:g}", server.base_url, model, args.light_rate, args)
            light = asyncio.run(run_benchmark(light_specs, light_config))
            print(format_run(light))
            specs = build_workload(WorkloadConfig("mixed", args.num_prompts, args.seed))
            saturated_config = _run_config(f"{label}@inf", server.base_url, model, math.inf, args)
            saturated = asyncio.run(run_benchmark(specs, saturated_config))
            print(format_run(saturated))
    except (ServerStartError, RuntimeError, OSError) as exc:
        return Measured(setup.name, mode, command, light, saturated, f"{type(exc).__name__}: {exc}", round_)
    return Measured(setup.name, mode, command, light, saturated, round=round_)


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def _verdict(d_ttft: float, ratio: float) -> str:
    ok = d_ttft <= TTFT_BUDGET_MS and ratio >= THROUGHPUT_FLOOR
    return f"{'meets' if ok else 'misses'} +{TTFT_BUDGET_MS:g} ms / {THROUGHPUT_FLOOR}x"


def report(results: Sequence[Measured]) -> str:
    """A Markdown table per mode: TTFT p50 at light load and saturated throughput, each against the plain server
    with as many threads per server (proxy-2x1 against the 2-thread plain server: the same cores in all) measured
    in the same round; with several rounds, a median line per proxy setup carries the verdict."""
    lines = []
    baselines = {s.name: ("plain" if s.name == "proxy-2x1" else s.baseline) for s in SETUPS}
    rounds = sorted({r.round for r in results})
    for mode in MODES:
        mode_rows = [r for r in results if r.mode == mode]
        if not mode_rows:
            continue
        lines += [
            f"### {mode}",
            "",
            "| round | setup | TTFT p50, light (ms) | vs plain (ms) | output tok/s, saturated | vs plain | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        deltas: dict[str, list[tuple[float, float]]] = {}
        for row in mode_rows:
            plain = next(
                (r for r in mode_rows if r.round == row.round and r.setup == baselines.get(row.setup, "plain")), None
            )
            ttft, tput = row.ttft_p50_ms(), row.throughput()
            base_ttft = plain.ttft_p50_ms() if plain else None
            base_tput = plain.throughput() if plain else None
            d_ttft = None if ttft is None or base_ttft is None else ttft - base_ttft
            ratio = None if tput is None or not base_tput else tput / base_tput
            verdict = row.error or ""
            if row.setup.startswith("proxy-") and d_ttft is not None and ratio is not None:
                deltas.setdefault(row.setup, []).append((d_ttft, ratio))
                if row.setup in ("proxy-1x2", "proxy-1x1"):
                    verdict = _verdict(d_ttft, ratio)
            lines.append(
                f"| {row.round} | {row.setup} | {_fmt(ttft, '.1f')} | {_fmt(d_ttft, '+.1f')} | {_fmt(tput, '.1f')} | "
                f"{_fmt(ratio, '.2f')}x | {verdict} |"
            )
        if len(rounds) > 1:
            for setup, pairs in deltas.items():
                d_ttft = statistics.median(d for d, _ in pairs)
                ratio = statistics.median(r for _, r in pairs)
                verdict = _verdict(d_ttft, ratio) if setup in ("proxy-1x2", "proxy-1x1") else ""
                lines.append(f"| median of {len(pairs)} | {setup} | | {d_ttft:+.1f} | | {ratio:.2f}x | {verdict} |")
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ray", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for result.json, report.md and logs")
    parser.add_argument("--model", default=None, help="batchserve --model (default: its default model)")
    add_seats_argument(parser, help="seats per replica (and of the plain server)")
    parser.add_argument("--num-prompts", type=int, default=48, help="saturated run: all sent at once")
    parser.add_argument("--light-prompts", type=int, default=24, help="light run: requests at --light-rate")
    parser.add_argument("--light-rate", type=float, default=0.5, help="req/s of the light run (Poisson)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of dynamic, continuous")
    parser.add_argument(
        "--setups",
        default=",".join(DEFAULT_SETUPS),
        help=f"comma list of setups, of {', '.join(s.name for s in SETUPS)}",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the setups in turn this many times; verdicts take the median"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--health-timeout", type=float, default=400.0, help="seconds; Ray's start is slow")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    setups = [s for s in SETUPS if s.name in args.setups.split(",")]
    if not setups or any(m not in MODES for m in modes):
        build_parser().error("unknown --modes or --setups")
    if args.rounds < 1:
        build_parser().error("--rounds must be at least 1")
    results = [
        measure(setup, mode, args, args.out / "raw", round_)
        for mode in modes
        for round_ in range(args.rounds)
        for setup in setups
    ]
    for failed in (r for r in results if r.error):
        print(f"{failed.setup}/{failed.mode} failed: {failed.error}", file=sys.stderr)
    text = report(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(
        f"# Ray Serve's proxy cost\n\n`{shlex.join([sys.executable, '-m', 'benchmarks', 'ray', *argv])}`\n\n{text}"
    )
    document = {
        "command": shlex.join([sys.executable, "-m", "benchmarks", "ray", *argv]),
        # Settings that change the measured path without showing in the command (Ray's ingress, OpenMP's waits);
        # OMP_NUM_THREADS is each setup's own.
        "environment": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(("RAY_SERVE_", "RAY_worker_", "OMP_")) and k != "OMP_NUM_THREADS"
        },
        "runs": [
            {
                "setup": r.setup,
                "mode": r.mode,
                "round": r.round,
                "server": r.command,
                "error": r.error,
                "light": None if r.light is None else r.light.to_dict(include_records=False),
                "saturated": None if r.saturated is None else r.saturated.to_dict(include_records=False),
            }
            for r in results
        ],
    }
    write_json(args.out / "result.json", document)
    print(f"wrote {args.out / 'report.md'} and {args.out / 'result.json'}")
    return 0 if not any(r.error for r in results) else 1
