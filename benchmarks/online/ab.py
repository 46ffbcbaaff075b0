"""A/B driver: the same workload against batchserve in each mode (dynamic and continuous unless --modes), plus
baselines.

    python -m benchmarks ab --workload mixed --num-prompts 48 --seats 8 --out benchmarks/results/mixed-8 \
        --sweep-rates 0.5,1,2,inf
    python -m benchmarks ab --modes static,dynamic,continuous --policy MODULE:CLASS --out ...

Each server is started on a free port, waited on until /health is 200, measured, and stopped (SIGTERM, then
SIGKILL after a grace period) before the next starts, so runs never share the machine.
Every later batchserve server starts on the first one's weight format, as explicit flags (format_pin.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from api.runtime.format_choice import format_label
from benchmarks.loadgen.client import discover_model
from benchmarks.loadgen.flags import add_load_arguments, add_seats_argument, parse_rates, run_config, workload_config
from benchmarks.loadgen.run import RunConfig, RunResult, merge_rounds, rate_to_json, run_benchmark
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess, ServerStartError
from benchmarks.loadgen.trace import export_runs
from benchmarks.loadgen.workloads import RequestSpec, build_workload
from benchmarks.online.format_pin import Pin, is_batchserve, pin_from, pinned, provisional, served_format
from benchmarks.peers.targets import (
    BASELINES,
    ServerSettings,
    Target,
    Unavailable,
    baseline_targets,
    mode_targets,
    run_prepare,
)
from benchmarks.results_io.report import NO_CACHE_SUFFIX, ABOutcome, columns_table, write_report
from benchmarks.results_io.tables import format_run
from engine.spec.config import SpeculativeConfig
from scheduler.lineup import DEFAULT, SPEC_SUFFIX, SYNTAX, Entry, checked, parse_entry, parse_lineup

_DESCRIPTION = "Compare batchserve's batching modes (and plug-in policies) on one workload."


@dataclass(frozen=True)
class TargetOutcome:
    target: Target
    command: str
    main: RunResult | None
    sweep: tuple[RunResult, ...]
    error: str | None


def lineup(args: argparse.Namespace) -> tuple[Entry, ...]:
    """--modes, then --policy; ValueError naming what is wrong."""
    entries = list(parse_lineup(args.modes))
    if args.policy is not None:
        entries.append(parse_entry(args.policy))
    return checked(entries)


def parse_baselines(text: str) -> tuple[str, ...]:
    if text.strip().lower() == "none":
        return ()
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baselines {unknown}; choose from {', '.join(BASELINES)} or none")
    return names


# (target, base_url, model, request rate or None for the main run) -> the run's config
ConfigFactory = Callable[[Target, str, str | None, float | None], RunConfig]


def config_factory(args: argparse.Namespace) -> ConfigFactory:
    """Every run shares the CLI's workload and load flags; only the server, model and rate vary."""

    def make(target: Target, base_url: str, model: str | None, rate: float | None) -> RunConfig:
        label = target.name if rate is None else f"{target.name}@{rate:g}"
        return run_config(args, base_url, label, model, request_rate=rate, eos_policy=target.eos_policy)

    return make


def run_target(
    target: Target,
    specs: Sequence[RequestSpec],
    make_config: ConfigFactory,
    sweep_rates: Sequence[float],
    log_path: Path,
    launch: LaunchConfig,
) -> TargetOutcome:
    """Start the server, run the workload (and the sweep), stop it. Failures are returned, not raised."""
    server = ServerProcess(target.launch(launch), log_path)
    command = shlex.join(server.command)
    main: RunResult | None = None
    sweep: list[RunResult] = []
    try:
        if target.prepare:
            run_prepare(target.prepare, log_path)
        # A first start takes minutes (conversion, kernels, format timing) and logs only to its file: say where.
        print(f"{target.name}: starting its server; its progress: {log_path}", file=sys.stderr, flush=True)
        with server:
            model = asyncio.run(discover_model(server.base_url))
            main = asyncio.run(run_benchmark(specs, make_config(target, server.base_url, model, None)))
            print(format_run(main))
            for rate in sweep_rates:
                run = asyncio.run(run_benchmark(specs, make_config(target, server.base_url, model, rate)))
                print(format_run(run))
                sweep.append(run)
    except (ServerStartError, RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        return TargetOutcome(target, command, main, tuple(sweep), f"{type(exc).__name__}: {exc}")
    return TargetOutcome(target, command, main, tuple(sweep), None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ab", description=_DESCRIPTION)
    parser.add_argument("--out", type=Path, required=True, help="folder for result.json, report.md, plots")
    g = parser.add_argument_group("servers")
    g.add_argument("--modes", default=DEFAULT, help=f"{SYNTAX} (default: {DEFAULT})")
    g.add_argument("--policy", default=None, help="one more run: a plug-in policy [NAME=]MODULE:CLASS")
    add_seats_argument(g, help="every mode's seats: max-batch-size = max-num-seqs")
    g.add_argument("--model", default=None, help="batchserve --model (default: its default model)")
    g.add_argument("--batch-timeout-ms", type=float, default=None)
    g.add_argument("--batch-window-ms", type=float, default=None, help="static: the ticks' period")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-queue", type=int, default=None)
    g.add_argument("--device", default=None, help="batchserve --device: cpu, cuda or auto")
    g.add_argument("--dtype", default=None, help="batchserve --dtype: auto, float32 or bfloat16")
    g.add_argument("--quantization", default=None, help="batchserve --quantization: auto, none, int8 or int4")
    g.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        help=f"comma list of {', '.join(BASELINES)}, or none; each runs only if available",
    )
    g.add_argument(
        "--prefix-caching",
        choices=("on", "off", "both"),
        default="on",
        help="batchserve's prefix caching; both: each mode also runs with it off, as <mode>-nocache",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='batchserve --speculative-config JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    g.add_argument(
        "--speculation",
        choices=("on", "off", "both"),
        default=None,
        help=f"on with --speculative-config (the default when it is given); both: each mode also runs with it, as "
        f"<mode>{SPEC_SUFFIX}",
    )
    g.add_argument("--sweep-rates", default=None, help="e.g. 0.5,1,2,inf: rerun every mode at each rate (round 1)")
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every target this many times, interleaved (a round starts each server once, in order); the report "
        "gives each round's ratios to the first target and their median, and the headline pools the rounds",
    )
    g.add_argument(
        "--export-workload",
        action="store_true",
        help="also write each run's requests as OUT/workload/<run>.jsonl, for python -m benchmarks simulate --replay "
        "(with --rounds, the first round's: every round sends the same requests)",
    )
    g.add_argument("--health-timeout", type=float, default=180.0, help="seconds to wait for /health")
    g.add_argument("--stop-grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    add_load_arguments(parser)
    return parser


def speculation_variants(
    settings: ServerSettings, speculation: str | None, config: str | None
) -> list[tuple[ServerSettings, str]]:
    """The (settings, run-name suffix) pairs each mode runs with: speculation is a dimension beside the modes.
    ValueError naming the flag when --speculation asks for a config that is missing or malformed."""
    flag = speculation or ("on" if config is not None else "off")
    if flag == "off":
        if config is not None:
            raise ValueError("--speculative-config is given but --speculation is off")
        return [(settings, "")]
    if config is None:
        raise ValueError(f"--speculation {flag} needs --speculative-config")
    try:
        SpeculativeConfig.from_json(config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--speculative-config {exc}") from None
    spec = dataclasses.replace(settings, speculative_config=config)
    return [(spec, "")] if flag == "on" else [(settings, ""), (spec, SPEC_SUFFIX)]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        specs = build_workload(workload_config(args))
        modes = lineup(args)
        settings = ServerSettings(
            seats=args.seats,
            model=args.model,
            batch_timeout_ms=args.batch_timeout_ms,
            batch_window_ms=args.batch_window_ms,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_queue=args.max_queue,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            enable_prefix_caching=args.prefix_caching != "off",
        )
        variants = speculation_variants(settings, args.speculation, args.speculative_config)
        settings = variants[0][0]
        sweep_rates = parse_rates(args.sweep_rates) if args.sweep_rates else ()
        baselines = parse_baselines(args.baselines)
        launch = LaunchConfig(
            argv=("set per target",), health_timeout_s=args.health_timeout, stop_grace_s=args.stop_grace
        )
        slo = run_config(args, "http://127.0.0.1:1", "check", None).slo  # validates the load flags before any server
        if args.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    command = shlex.join([sys.executable, "-m", "benchmarks", "ab", *argv])
    make_config = config_factory(args)

    servers: dict[str, str] = {}
    notes: dict[str, str] = {}
    sweep: dict[str, list[RunResult]] = {}
    skipped: dict[str, str] = {}
    targets = mode_targets(settings, modes)
    if args.prefix_caching == "both":
        targets += mode_targets(dataclasses.replace(settings, enable_prefix_caching=False), modes, NO_CACHE_SUFFIX)
    for spec_settings, suffix in variants[1:]:
        targets += mode_targets(spec_settings, modes, suffix)
    names = [entry.name for entry in modes]
    weights: dict[str, str] = {}  # each batchserve server's format, from its log
    pin: Pin | None = None
    rounds: dict[str, list[RunResult]] = {}
    items = [*targets, *baseline_targets(baselines, settings)]
    for round_index in range(args.rounds):
        for item in items:
            if isinstance(item, Unavailable):
                if round_index == 0:
                    skipped[item.name] = item.reason
                    print(f"skipping {item.name}: {item.reason}", file=sys.stderr)
                continue
            if item.name in skipped:
                continue  # failed in an earlier round
            is_mode = item.name in names
            if pin is not None and is_batchserve(item):
                item = pinned(item, pin)
            log_name = item.name if round_index == 0 else f"{item.name}.round{round_index + 1}"
            log_path = args.out / "raw" / f"{log_name}.server.log"
            rates = sweep_rates if is_mode and round_index == 0 else ()
            outcome = run_target(item, specs, make_config, rates, log_path, launch)
            served = served_format(log_path) if is_batchserve(item) else None
            if served is not None:
                weights[item.name] = format_label(*served)
                if pin is None and outcome.error is None and provisional(log_path):
                    pin = pin_from(served, item.name, args.dtype, args.quantization)
                    if pin is not None:
                        print(
                            f"weights: {weights[item.name]}, as {item.name} resolved auto: pinned for every later "
                            f"batchserve server ({' '.join(pin.flags())})",
                            file=sys.stderr,
                        )
            servers[item.name], notes[item.name] = outcome.command, item.note
            if outcome.main is not None:
                rounds.setdefault(item.name, []).append(outcome.main)
            if outcome.sweep:
                sweep[item.name] = list(outcome.sweep)
            if outcome.error is not None:
                skipped[item.name] = f"failed: {outcome.error.splitlines()[0]} (log: raw/{log_name}.server.log)"
                print(f"{item.name} failed: {outcome.error}", file=sys.stderr)
    runs = {name: merge_rounds(results, slo) for name, results in rounds.items()}

    settings_doc = {
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "seats": args.seats,
        "modes": [entry.description for entry in modes],
        "request_rate": rate_to_json(args.request_rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "model": args.model,
        "device": args.device,
        "sweep_rates": [str(r) for r in sweep_rates],
        "rounds": args.rounds,
        "prefix_caching": args.prefix_caching,
        "speculation": args.speculation or ("on" if args.speculative_config else "off"),
        "speculative_config": args.speculative_config,
        "goodput": args.goodput,
        "weights": weights,
        "weights_pinned_from": pin.source if pin is not None else None,
    }
    ab = ABOutcome(
        command, settings_doc, servers, notes, runs, sweep, skipped, modes=tuple(names),
        rounds=rounds if args.rounds > 1 else {},
    )  # fmt: skip
    if len(runs) > 1:
        print(columns_table(runs))
    written = write_report(ab, args.out)
    print(f"wrote {written['report.md']} and {written['result.json']}")
    if args.export_workload:
        first_rounds = {name: results[0] for name, results in rounds.items()}  # every round sends the same requests
        print(f"wrote workload traces to {export_runs(args.out, first_rounds, sweep, specs)}")
    return 0 if set(names) <= runs.keys() else 1
