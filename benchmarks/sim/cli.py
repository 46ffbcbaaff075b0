"""Simulate batchserve on a virtual clock: the real scheduler and policies over a simulated engine.

    python -m benchmarks simulate --cost-model cost.json --workload mixed --num-prompts 48 --seats 8 \
        --request-rate inf --out benchmarks/results/sim-mixed-8
    python -m benchmarks simulate --gpu h100 --model-config llama-3-8b --seats 64 --workload mixed \
        --num-prompts 2000 --sweep-rates 1,2,4,8,16,32 --out benchmarks/results/sim-h100
    python -m benchmarks simulate --cost-model cost.json --workload run.jsonl --compare-with result.json

Each mode runs `scheduler.core.Scheduler` with `StaticPolicy`, `DynamicPolicy`, `ContinuousPolicy` or a plug-in
policy (`--policy MODULE:CLASS`), the classes `serve` runs, over `benchmarks.sim.engine.SimEngine`; only the
engine's step time is modelled (`benchmarks.sim.cost.model`). The output folder has the same `result.json` schema,
report and plots as `benchmarks.online.ab`, marked as simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from api.config import DEFAULT_LONE_PREFILL_TOKENS, DEFAULT_MAX_MODEL_LEN
from benchmarks.loadgen.arrivals import ArrivalConfig
from benchmarks.loadgen.flags import add_seats_argument, parse_rates
from benchmarks.loadgen.run import RunResult, rate_to_json
from benchmarks.loadgen.trace import ExportedRuns, TraceRequest, at_once, read_exported, read_trace, synthesize
from benchmarks.loadgen.workloads import WORKLOADS, WorkloadConfig
from benchmarks.results_io.report import NO_CACHE_SUFFIX, ABOutcome, columns_table
from benchmarks.results_io.tables import format_run
from benchmarks.sim.cluster import ROUTERS
from benchmarks.sim.cost.files import (
    BusyArrival,
    load_busy_arrival,
    load_fitted,
    load_request_overhead,
    verify_steps_note,
)
from benchmarks.sim.cost.model import CostModel
from benchmarks.sim.cost.roofline import GPUS, RooflineCostModel, load_model_shape
from benchmarks.sim.cost.served import load_served_extras, served_load_modes, with_served_extra
from benchmarks.sim.engine import DEFAULT_ACCEPTANCE_RATE, DEFAULT_DRAFT_RATE
from benchmarks.sim.report import write_sim_report
from benchmarks.sim.run import SimSettings, simulate_trace
from benchmarks.sim.validate.headline import validation_table
from engine.config import EngineConfig
from engine.spec.config import SpeculativeConfig
from scheduler.config import SchedulerConfig
from scheduler.lineup import DEFAULT, SPEC_SUFFIX, SYNTAX, Entry, checked, parse_entry, parse_lineup

_DESCRIPTION = "Simulate static, dynamic and continuous batching (and plug-in policies) on a virtual clock."
_S = SchedulerConfig()
_W = WorkloadConfig()
_A = ArrivalConfig()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks simulate", description=_DESCRIPTION)
    parser.add_argument("--out", type=Path, default=None, help="folder for result.json, report.md, plots")
    parser.add_argument(
        "--mode",
        default="both",
        help=f"{SYNTAX}; both: dynamic,continuous (default: both)",
    )
    g = parser.add_argument_group("policy (serve's flags and defaults)")
    g.add_argument("--policy", default=None, help="one more run: a plug-in policy [NAME=]MODULE:CLASS")
    add_seats_argument(g)
    g.add_argument("--max-batch-size", type=int, default=None, help="dynamic and static seats (default: --seats)")
    g.add_argument("--batch-timeout-ms", type=float, default=_S.batch_timeout_ms)
    g.add_argument("--batch-window-ms", type=float, default=_S.batch_window_ms, help="static: the ticks' period")
    g.add_argument("--max-num-seqs", type=int, default=None, help="continuous seats (default: --seats)")
    g.add_argument("--max-num-batched-tokens", type=int, default=_S.max_num_batched_tokens)
    g.add_argument(
        "--lone-prefill-tokens",
        type=int,
        default=DEFAULT_LONE_PREFILL_TOKENS,
        help="continuous: the budget of a step with only prompt chunks (serve's default; 0: off)",
    )
    g.add_argument("--max-queue", type=int, default=_S.max_queue)
    g.add_argument("--queue-timeout-s", type=float, default=None)
    g.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="default: seats x max-model-len (GPU: capped)")
    g.add_argument(
        "--prefix-caching",
        choices=("on", "off", "both"),
        default="on",
        help="the engine's prefix caching, as `ab`'s flag; both: each mode also runs with it off, as <mode>-nocache",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='serve\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\': rows verify drafts, '
        "accepted as --acceptance-rate says",
    )
    g.add_argument(
        "--speculation",
        choices=("on", "off", "both"),
        default=None,
        help=f"as `ab`'s: on with --speculative-config (its default); both: each mode also runs with it, as "
        f"<mode>{SPEC_SUFFIX}",
    )
    g.add_argument(
        "--acceptance-rate",
        type=float,
        default=DEFAULT_ACCEPTANCE_RATE,
        help="the workload's chance that a draft is right, each independently up to the first wrong one (vLLM's "
        f"synthetic acceptance; default {DEFAULT_ACCEPTANCE_RATE})",
    )
    g.add_argument(
        "--draft-rate",
        type=float,
        default=DEFAULT_DRAFT_RATE,
        help="the chance that a row has drafts at a step where it samples (n-gram lookup finds a match); a spec "
        f"run's drafts over its generated less accepted tokens (default {DEFAULT_DRAFT_RATE}: every row drafts)",
    )
    g = parser.add_argument_group("cost model (one of)")
    g.add_argument("--cost-model", type=Path, default=None, help="cost.json from `python -m benchmarks fit-cost`")
    g.add_argument("--gpu", choices=sorted(GPUS), default=None, help="roofline projection for this GPU")
    g.add_argument("--model-config", default="llama-3-8b", help="with --gpu: config dir or built-in llama-3-8b")
    g.add_argument("--step-overhead-ms", type=float, default=1.0, help="with --gpu: fixed cost per step")
    g.add_argument(
        "--request-overhead-ms",
        type=float,
        default=None,
        help="time each request spends outside the steps (HTTP, tokenising, SSE), added to its latency "
        "(default: the served probe's figure in cost.json; 0 with --gpu); a mid-step arrival's extra is "
        "--busy-arrival's",
    )
    g.add_argument(
        "--served-load",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="charge each step what a served step of that mode costs over the profiled one (cost.json's "
        "served.load, when the profile ran its load probe), in --served-load-modes",
    )
    g.add_argument(
        "--served-load-modes",
        default="continuous",
        help="modes whose load-probe charge applies (comma list). Not dynamic by default: the bus serves a "
        "batch's tokens at its release, not step by step, and its measured charge moved 0.24-1.38 ms a token "
        "between profiles minutes apart (docs/simulator.md)",
    )
    g.add_argument(
        "--busy-arrival",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a request that arrives while a step runs makes that step longer and its own path outside the "
        "steps longer (cost.json's served probe, when it ran its busy phase)",
    )
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--workload", default=_W.name, help="mixed, uniform, long-prompt, multi-turn, shared-prefix, or FILE.jsonl"
    )
    g.add_argument("--num-prompts", type=int, default=_W.num_prompts)
    g.add_argument("--seed", type=int, default=_W.seed)
    g.add_argument("--input-len", type=int, default=_W.input_len)
    g.add_argument("--output-len", type=int, default=_W.output_len)
    g.add_argument("--turns", type=int, default=_W.turns, help="multi-turn: turns per conversation")
    g.add_argument("--system-prompt-words", type=int, default=_W.system_prompt_words, help="multi-turn")
    g.add_argument("--prefix-groups", type=int, default=_W.prefix_groups, help="shared-prefix: distinct prefixes")
    g.add_argument("--prefix-words", type=int, default=_W.prefix_words, help="shared-prefix: words of each prefix")
    g.add_argument("--request-rate", type=float, default=_A.request_rate, help="req/s; inf: all at once")
    g.add_argument("--burstiness", type=float, default=_A.burstiness)
    g.add_argument("--sweep-rates", default=None, help="e.g. 0.5,1,2,inf: rerun each mode at each rate")
    g = parser.add_argument_group("scale-out and analysis")
    g.add_argument("--replicas", type=int, default=1, help="simulated servers behind a router")
    g.add_argument("--router", choices=ROUTERS, default="round-robin")
    g.add_argument(
        "--replay",
        type=Path,
        default=None,
        help="a `python -m benchmarks ab --export-workload` folder: replay each run's trace in its mode, compare with "
        "its result",
    )
    g.add_argument(
        "--replay-at-once",
        action="store_true",
        help="with --replay: every request arrives at time 0 and the seats bound how many run, as a closed loop of "
        "--seats clients at an infinite rate keeps them (such a run's recorded arrivals followed the server's speed)",
    )
    g.add_argument(
        "--compare-with", type=Path, default=None, help="a real benchmarks.online.ab result.json: error table"
    )
    g.add_argument(
        "--find-max-rate",
        action="store_true",
        help="bisect the highest request rate whose TTFT p99 stays under --ttft-p99-ms with nothing refused",
    )
    g.add_argument("--ttft-p99-ms", type=float, default=2000.0)
    g.add_argument(
        "--sustain-s",
        type=float,
        default=30.0,
        help="--find-max-rate: each rate sends max(--num-prompts, rate x this) requests, so a queue that grows "
        "without bound shows in TTFT p99 instead of being hidden by a short run",
    )
    return parser


def cost_model_from(args: argparse.Namespace) -> tuple[CostModel, int | None]:
    """The cost model, and the KV cache the GPU holds (None: no limit beyond the flags)."""
    if (args.cost_model is None) == (args.gpu is None):
        raise ValueError("give exactly one of --cost-model cost.json or --gpu NAME (with --model-config)")
    if args.cost_model is not None:
        return load_fitted(args.cost_model), None
    roofline = RooflineCostModel(GPUS[args.gpu], load_model_shape(args.model_config), args.step_overhead_ms / 1e3)
    return roofline, roofline.kv_cache_tokens()


def lineup(args: argparse.Namespace) -> tuple[Entry, ...]:
    """--mode's list (`both`: dynamic,continuous) and --policy; ValueError naming what is wrong."""
    entries = list(parse_lineup(DEFAULT if args.mode.strip() == "both" else args.mode))
    if args.policy is not None:
        entries.append(parse_entry(args.policy))
    return checked(entries)


def speculation_runs(flag: str | None, config: str | None) -> list[tuple[SpeculativeConfig | None, str]]:
    """--speculation and --speculative-config as `ab` reads them: (config, run name suffix) per run of each mode;
    ValueError naming the flag."""
    flag = flag or ("on" if config is not None else "off")
    if flag == "off":
        if config is not None:
            raise ValueError("--speculative-config is given but --speculation is off")
        return [(None, "")]
    if config is None:
        raise ValueError(f"--speculation {flag} needs --speculative-config")
    try:
        spec = SpeculativeConfig.from_json(config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--speculative-config {exc}") from None
    return [(spec, "")] if flag == "on" else [(None, ""), (spec, SPEC_SUFFIX)]


def scheduler_configs(args: argparse.Namespace) -> dict[str, SchedulerConfig]:
    """Each run's scheduler, by the run's name (a mode's speculating twin: <mode>-spec)."""
    return {
        entry.name + suffix: SchedulerConfig(
            mode=entry.mode,
            max_batch_size=args.max_batch_size or args.seats,
            batch_timeout_ms=args.batch_timeout_ms,
            batch_window_ms=args.batch_window_ms,
            max_num_seqs=args.max_num_seqs or args.seats,
            max_num_batched_tokens=args.max_num_batched_tokens,
            lone_prefill_tokens=args.lone_prefill_tokens or None,
            policy=entry.policy,
            max_queue=args.max_queue,
            queue_timeout_s=args.queue_timeout_s,
            speculative=spec,
        )
        for spec, suffix in speculation_runs(args.speculation, args.speculative_config)
        for entry in lineup(args)
    }


def engine_config(args: argparse.Namespace, scheduler: SchedulerConfig, gpu_tokens: int | None) -> EngineConfig:
    """As `serve` sizes it (api.config.RuntimeOptions.engine_config), within what the GPU holds."""
    tokens = args.kv_cache_tokens or scheduler.seats * args.max_model_len
    if gpu_tokens is not None:
        tokens = min(tokens, gpu_tokens)
    return EngineConfig(max_rows=scheduler.seats, kv_cache_tokens=tokens, max_model_len=args.max_model_len)


def is_trace_file(workload: str) -> bool:
    return workload.endswith(".jsonl") or Path(workload).is_file()


def trace_for(args: argparse.Namespace, rate: float, num_prompts: int | None = None) -> list[TraceRequest]:
    if is_trace_file(args.workload):
        return read_trace(Path(args.workload))
    workload = WorkloadConfig(
        name=args.workload,
        num_prompts=num_prompts or args.num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        turns=args.turns,
        system_prompt_words=args.system_prompt_words,
        prefix_groups=args.prefix_groups,
        prefix_words=args.prefix_words,
    )
    return synthesize(workload, ArrivalConfig(request_rate=rate, burstiness=args.burstiness, seed=args.seed))


def run_one(args: argparse.Namespace, settings: SimSettings, rate: float, label: str) -> RunResult:
    return _timed(trace_for(args, rate), settings, label, rate, args.burstiness)


def _timed(
    trace: Sequence[TraceRequest], settings: SimSettings, label: str, rate: float, burstiness: float
) -> RunResult:
    started = time.perf_counter()
    result = simulate_trace(trace, settings, label, rate, burstiness)
    elapsed = time.perf_counter() - started
    print(f"simulated {len(trace)} requests ({label}) in {elapsed:.2f} s of wall time", file=sys.stderr)
    return result


def find_max_rate(
    sustains: Callable[[float], bool], low: float = 0.0, high: float = 1.0, iterations: int = 10
) -> float:
    """The highest rate for which `sustains(rate)` holds, assuming it holds below some rate and fails above."""
    while sustains(high):
        low, high = high, high * 2
        if high > 1e6:
            return math.inf
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if sustains(middle) else (low, middle)
    return low


def simulation_settings(args: argparse.Namespace) -> tuple[CostModel, dict[str, SimSettings]]:
    """The cost model and each mode's simulated servers, as the flags ask; ValueError or OSError when they can't."""
    cost, gpu_tokens = cost_model_from(args)
    # a profile's served probe measured what a request pays outside the steps; a GPU projection has none
    if args.request_overhead_ms is not None:
        overhead = args.request_overhead_ms / 1e3
    else:
        overhead = load_request_overhead(args.cost_model) if args.cost_model is not None else 0.0
    extras = load_served_extras(args.cost_model) if args.cost_model is not None and args.served_load else {}
    charged = served_load_modes(args.served_load_modes)
    if args.served_load and args.cost_model is not None and (unmeasured := set(charged) - set(extras)):
        print(f"note: {args.cost_model} has no load probe of {sorted(unmeasured)}: not charged", file=sys.stderr)
    extras = {mode: extra for mode, extra in extras.items() if mode in charged}
    speculating = args.speculative_config and args.speculation != "off"
    if speculating and args.cost_model is not None and (note := verify_steps_note(args.cost_model)) is not None:
        print(note, file=sys.stderr)
    busy = load_busy_arrival(args.cost_model) if args.cost_model is not None and args.busy_arrival else BusyArrival()
    settings = {
        name: SimSettings(
            c,
            dataclasses.replace(engine_config(args, c, gpu_tokens), enable_prefix_caching=caching),
            with_served_extra(cost, extras, c.mode.value),  # a plug-in pays what its mode's served steps pay
            args.replicas,
            args.router,
            request_overhead_s=overhead,
            busy_arrival=busy,
            acceptance_rate=args.acceptance_rate,
            draft_rate=args.draft_rate,
            seed=args.seed,
        )
        for caching, suffix in prefix_caching_runs(args.prefix_caching)
        for run, c in scheduler_configs(args).items()
        for name in [run + suffix]
    }
    return cost, settings


def prefix_caching_runs(flag: str) -> list[tuple[bool, str]]:
    """--prefix-caching: (caching on, run name suffix) per run of each mode, as `ab` names them."""
    return {"on": [(True, "")], "off": [(False, "")], "both": [(True, ""), (False, NO_CACHE_SUFFIX)]}[flag]


def check_workload(args: argparse.Namespace, sweep_rates: Sequence[float]) -> None:
    """ValueError unless the workload flags name a generator or a trace, and fit the other flags."""
    if (sweep_rates or args.find_max_rate) and (is_trace_file(args.workload) or args.replay is not None):
        raise ValueError("a trace file fixes arrival times: --sweep-rates and --find-max-rate need a generator")
    if not is_trace_file(args.workload) and args.workload not in WORKLOADS:
        raise ValueError(f"--workload must be one of {WORKLOADS[:-1]} or a .jsonl trace, got {args.workload!r}")
    if not is_trace_file(args.workload):
        trace_for(args, args.request_rate)  # validate the workload flags before simulating


def cost_labels(settings: dict[str, SimSettings]) -> dict[str, str]:
    """Each mode's cost model as the report names it, with what the served probe adds to every request."""
    first = next(iter(settings.values()))
    overhead, busy = first.request_overhead_s, first.busy_arrival
    suffix = f"; {1e3 * overhead:.1f} ms a request outside the steps (served probe)" if overhead else ""
    if busy != BusyArrival():
        suffix += (
            f"; arriving mid-step: +{1e3 * busy.stall_s:.1f} ms to the step, +{1e3 * busy.outside_s:.1f} ms outside"
        )
    return {mode: s.cost.label + suffix for mode, s in settings.items()}


def sweep(
    args: argparse.Namespace, settings: dict[str, SimSettings], sweep_rates: Sequence[float]
) -> tuple[dict[str, RunResult], dict[str, list[RunResult]]]:
    """Each mode at --request-rate, then at each of --sweep-rates, on the generated workload (or the trace file)."""
    runs: dict[str, RunResult] = {}
    swept: dict[str, list[RunResult]] = {}
    for mode, mode_settings in settings.items():
        runs[mode] = run_one(args, mode_settings, args.request_rate, mode)
        for rate in sweep_rates:
            swept.setdefault(mode, []).append(run_one(args, mode_settings, rate, f"{mode}@{rate:g}"))
    return runs, swept


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cost, settings = simulation_settings(args)
        sweep_rates = parse_rates(args.sweep_rates) if args.sweep_rates else ()
        check_workload(args, sweep_rates)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    labels = cost_labels(settings)
    distinct = sorted(set(labels.values()))  # one per mode where a load probe's charge differs
    print("\n".join(distinct), file=sys.stderr)

    if args.find_max_rate:
        return print_max_rates(args, settings)
    if args.replay is not None:
        runs, swept = replay(args, settings)
        if args.compare_with is None and (args.replay / "result.json").is_file():
            args.compare_with = args.replay / "result.json"
    else:
        runs, swept = sweep(args, settings, sweep_rates)
    for run in runs.values():
        print(format_run(run))
    if len(runs) > 1:
        print(columns_table(runs))
    if args.compare_with is not None:
        real = json.loads(args.compare_with.read_text())
        print(f"validation against {args.compare_with} (error: simulated vs measured)")
        print(validation_table(real, runs, swept))
    if args.out is not None:
        outcome = ABOutcome(
            shlex.join([sys.executable, "-m", "benchmarks", "simulate", *argv]),
            _settings_doc(args, cost, settings),
            {mode: f"simulated: {s.scheduler}" for mode, s in settings.items()},
            labels,
            runs,
            swept,
            modes=tuple(settings),
        )
        written = write_sim_report(outcome, args.out, " | ".join(distinct))
        print(f"wrote {written['report.md']} and {written['result.json']}")
    return 0


def replay(
    args: argparse.Namespace, settings: dict[str, SimSettings]
) -> tuple[dict[str, RunResult], dict[str, list[RunResult]]]:
    """--replay: each mode's exported traces (main run and sweep), replayed in that mode."""
    exported = read_exported(args.replay)
    if args.replay_at_once:
        exported = ExportedRuns({mode: at_once(trace) for mode, trace in exported.main.items()}, exported.sweep)
    runs: dict[str, RunResult] = {}
    swept: dict[str, list[RunResult]] = {}
    for mode, mode_settings in settings.items():
        if mode in exported.main:
            runs[mode] = _timed(exported.main[mode], mode_settings, mode, args.request_rate, args.burstiness)
        for rate, trace in sorted(exported.sweep.get(mode, {}).items()):
            run = _timed(trace, mode_settings, f"{mode}@{rate:g}", rate, args.burstiness)
            swept.setdefault(mode, []).append(run)
    if not runs and not swept:
        raise SystemExit(f"{args.replay} has no trace for {', '.join(settings)}")
    return runs, swept


def print_max_rates(args: argparse.Namespace, settings: dict[str, SimSettings]) -> int:
    print(f"| mode | replicas | router | max req/s with TTFT p99 < {args.ttft_p99_ms:g} ms | output tok/s there |")
    print("|---|---|---|---|---|")
    for mode, mode_settings in settings.items():
        results: dict[float, RunResult] = {}

        def sustains(
            rate: float, mode: str = mode, mode_settings: SimSettings = mode_settings, results: dict = results
        ) -> bool:
            count = max(args.num_prompts, math.ceil(rate * args.sustain_s))
            run = simulate_trace(trace_for(args, rate, count), mode_settings, mode, rate, args.burstiness)
            results[rate] = run
            ttft = run.summary.ttft_ms
            return run.summary.failed == 0 and ttft is not None and ttft.p99 < args.ttft_p99_ms

        best = find_max_rate(sustains)
        tput = f"{results[best].summary.output_throughput:.0f}" if best in results else "n/a"
        print(f"| {mode} | {args.replicas} | {args.router} | {best:.2f} | {tput} |")
    return 0


def _settings_doc(args: argparse.Namespace, cost: CostModel, settings: dict[str, SimSettings]) -> dict[str, Any]:
    first = next(iter(settings.values()))
    engine = first.engine
    return {
        "simulated": True,
        "cost_model": cost.label,
        "cost_model_by_mode": {mode: s.cost.label for mode, s in settings.items()},
        "request_overhead_ms": 1e3 * first.request_overhead_s,
        "busy_arrival_ms": {"stall": 1e3 * first.busy_arrival.stall_s, "outside": 1e3 * first.busy_arrival.outside_s},
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "seats": args.seats,
        "request_rate": rate_to_json(args.request_rate),
        "burstiness": args.burstiness,
        "kv_cache_tokens": engine.kv_cache_tokens,
        "prefix_caching": args.prefix_caching,
        "max_model_len": args.max_model_len,
        "replicas": args.replicas,
        "router": args.router,
        "speculation": args.speculation or ("on" if args.speculative_config else "off"),
        "speculative_config": args.speculative_config,
        "acceptance_rate": args.acceptance_rate,
        "draft_rate": args.draft_rate,
        "sweep_rates": [str(r) for r in (parse_rates(args.sweep_rates) if args.sweep_rates else ())],
    }
