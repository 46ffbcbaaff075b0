"""The break-even batch size measured beside simulated: `python -m benchmarks spec-break-even --cost-model cost.json
--check DIR ...`, each DIR an `ab --speculation both` result folder (one per --seats / --max-concurrency).

For each folder and each mode it ran with and without speculation (`<mode>` and `<mode>-spec`), the measured speedup
is the spec run's output tokens per second over the plain run's. The simulator then runs the same requests at the same
concurrency (min of --seats, --max-concurrency and --num-prompts: a closed loop of c clients keeps at most c
requests in the server, and never more than it has) with the folder's --speculative-config, replaying the folder's
exported traces when it has them (`--export-workload`; a closed loop's all at once), else the workload its settings
name, over SEEDS seeds. The
acceptance rate R is --acceptance-rate, else the spec run's counters (accepted / drafted = (R + ... + R**k) / k
under synthetic acceptance with k drafts a row, solved for R), and the draft rate D is --draft-rate, else the spec
run's rows that verified drafts over its sampling row-steps (generated tokens less accepted ones; runs that predate
the drafts counter: draft tokens / k, each draft taken as k tokens long). The cost model's own prediction
(`spec_break_even.speedups` at the runs' mean context) sits beside. Each break-even is where the speedup crosses 1
over the folders' concurrencies (`crossing`). Where every folder ran `--rounds` (2 or more), the measured one carries
an interval: each concurrency's round ratios resampled with replacement, `INTERVAL_DRAWS` times, their means' crossing
at the 5th and 95th percentile. A flat curve near 1 (speculation neither pays nor costs) moves its crossing across
the whole range with the rounds' spread, and the interval says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.loadgen.run import RunResult
from benchmarks.sim import cli as simulate
from benchmarks.sim.cost.files import load_fitted
from benchmarks.sim.cost.speculation import crossing, expected_emitted, speedups
from engine.spec.config import SpeculativeConfig
from scheduler.lineup import SPEC_SUFFIX


@dataclass(frozen=True)
class Point:
    """One mode at one concurrency: speculation's speedup measured, simulated and from the cost model alone."""

    folder: Path
    mode: str
    concurrency: int
    rate: float
    draft_rate: float
    measured: float
    simulated: float
    predicted: float
    round_ratios: tuple[float, ...] = ()  # the measured speedup round by round (`ab --rounds`); () for one run


def rate_from_counters(drafted: float, accepted: float, k: int) -> float:
    """R such that accepted / drafted = (R + ... + R**k) / k (bisection: the left side grows with R)."""
    target = accepted / drafted
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if (expected_emitted(middle, k) - 1.0) / k < target:
            low = middle
        else:
            high = middle
    return low


def _throughput(run: dict[str, Any]) -> float:
    value = run["summary"]["output_throughput"]
    if not value:
        raise ValueError(f"run {run.get('label')!r} has no output throughput")
    return float(value)


def _rate(folder: Path, spec_run: dict[str, Any], k: int, given: float | None) -> float:
    if given is not None:
        return given
    metrics = spec_run.get("server_metrics") or {}
    drafted, accepted = metrics.get("draft_tokens"), metrics.get("accepted_tokens")
    if not drafted or accepted is None:
        raise ValueError(f"{folder}: the spec run recorded no draft counters; give --acceptance-rate")
    return rate_from_counters(float(drafted), float(accepted), k)


def _draft_rate(folder: Path, spec_run: dict[str, Any], k: int, given: float | None) -> float:
    if given is not None:
        return given
    metrics = spec_run.get("server_metrics") or {}
    generated, accepted = metrics.get("generation_tokens"), metrics.get("accepted_tokens")
    drafts = metrics.get("drafts")
    if drafts is None and metrics.get("draft_tokens") is not None:
        drafts = metrics["draft_tokens"] / k
    if not generated or accepted is None or drafts is None or generated <= accepted:
        raise ValueError(f"{folder}: the spec run recorded no draft or token counters; give --draft-rate")
    return min(1.0, float(drafts) / (float(generated) - float(accepted)))


def _round_ratios(document: dict[str, Any], mode: str) -> tuple[float, ...]:
    """The spec run's output tokens per second over the plain run's, round by round; () for a single round."""
    targets = (document.get("rounds") or {}).get("targets") or {}
    spec = (targets.get(mode + SPEC_SUFFIX) or {}).get("output_tok_s") or []
    plain = (targets.get(mode) or {}).get("output_tok_s") or []
    if len(spec) < 2 or len(spec) != len(plain) or not all(plain):
        return ()
    return tuple(on / off for on, off in zip(spec, plain, strict=True))


INTERVAL_DRAWS = 2000


def measured_interval(
    batches: Sequence[float], round_ratios: Sequence[Sequence[float]], draws: int = INTERVAL_DRAWS, seed: int = 0
) -> tuple[float, float] | None:
    """The 5th and 95th percentile of the break-even when each batch's rounds are resampled with replacement and
    their mean taken (math.inf where a resample pays at every batch); None unless every batch has 2 rounds or more."""
    if not round_ratios or any(len(ratios) < 2 for ratios in round_ratios):
        return None
    rng = np.random.default_rng(seed)
    means = np.stack([rng.choice(np.asarray(r), size=(draws, len(r))).mean(axis=1) for r in round_ratios], axis=1)
    found = [crossing(batches, list(row)) for row in means]
    values = np.array([math.inf if value is None else value for value in found])
    return float(np.percentile(values, 5, method="lower")), float(np.percentile(values, 95, method="higher"))


SEEDS = 5  # simulated runs per point, each with its own draft and acceptance draws: their mean ratio is reported


def _simulated(
    cost_model: Path, folder: Path, settings: dict[str, Any], mode: str, seats: int, rate: float, draft_rate: float
) -> float:
    """Simulated spec / plain output tokens per second for `mode` at `seats`, as the folder's runs were made: the
    mean over SEEDS seeds. A closed loop at an infinite rate is replayed at once (its recorded arrivals followed the
    server's own speed; the seats keep `seats` requests running, as its clients did)."""
    request_rate = str(settings.get("request_rate", "inf"))
    argv = ["--cost-model", str(cost_model), "--mode", mode, "--seats", str(seats), "--acceptance-rate", str(rate)]
    argv += ["--draft-rate", str(draft_rate)]
    argv += ["--speculative-config", settings["speculative_config"], "--speculation", "both"]
    argv += ["--request-rate", request_rate]
    if (folder / "workload").is_dir():
        argv += ["--replay", str(folder)]
        if request_rate == "inf" and settings.get("max_concurrency"):
            argv += ["--replay-at-once"]
    else:
        argv += ["--workload", str(settings["workload"]), "--num-prompts", str(settings["num_prompts"])]
    args = simulate.build_parser().parse_args(argv)
    first = int(settings.get("seed", 0))
    ratios = []
    for seed in range(first, first + SEEDS):
        args.seed = seed  # the workload's and the draws' seed, as --seed sets it
        _, sim_settings = simulate.simulation_settings(args)
        if args.replay is not None:
            runs: dict[str, RunResult] = simulate.replay(args, sim_settings)[0]
        else:
            simulate.check_workload(args, ())
            runs = simulate.sweep(args, sim_settings, ())[0]
        plain, spec = runs[mode].summary.output_throughput, runs[mode + SPEC_SUFFIX].summary.output_throughput
        ratios.append(spec / plain if plain else math.nan)
    return sum(ratios) / len(ratios)


def points(
    cost_model: Path, folders: Sequence[Path], acceptance_rate: float | None, draft_rate: float | None = None
) -> list[Point]:
    model = load_fitted(cost_model)
    out = []
    for folder in folders:
        document = json.loads((folder / "result.json").read_text())
        settings, runs = document.get("settings") or {}, document.get("runs") or {}
        if not settings.get("speculative_config"):
            raise ValueError(f"{folder}: not an `ab --speculation both` run (no speculative_config)")
        k = SpeculativeConfig.from_json(settings["speculative_config"]).num_speculative_tokens
        # A closed loop of c clients over n < c requests never has more than n in the server.
        bounds = (settings["seats"], settings.get("max_concurrency"), settings.get("num_prompts"))
        concurrency = min(int(bound) for bound in bounds if bound)
        pairs = [name for name in runs if name + SPEC_SUFFIX in runs]
        if not pairs:
            raise ValueError(f"{folder}: no <mode> and <mode>{SPEC_SUFFIX} runs side by side")
        for mode in pairs:
            plain, spec = runs[mode], runs[mode + SPEC_SUFFIX]
            rate = _rate(folder, spec, k, acceptance_rate)
            drafting = _draft_rate(folder, spec, k, draft_rate)
            summary = spec["summary"]
            done = max(int(summary["completed"]), 1)
            context = round(summary["input_tokens"] / done + summary["output_tokens"] / (2 * done))
            out.append(
                Point(
                    folder,
                    mode,
                    concurrency,
                    rate,
                    drafting,
                    _throughput(spec) / _throughput(plain),
                    _simulated(cost_model, folder, settings, mode, concurrency, rate, drafting),
                    float(speedups(model, rate, k, context, [concurrency], drafting)[0]),
                    _round_ratios(document, mode),
                )
            )
    return out


def _fmt(value: float | None) -> str:
    return "pays at every concurrency" if value is None else f"{value:.1f}"


def table(found: Sequence[Point]) -> str:
    lines = [
        "| folder | mode | concurrency | acceptance R | draft rate D | measured on/off | simulated | cost model |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(found, key=lambda p: (p.mode, p.concurrency)):
        lines.append(
            f"| {p.folder.name} | {p.mode} | {p.concurrency} | {p.rate:.2f} | {p.draft_rate:.2f} | {p.measured:.3f}x | "
            f"{p.simulated:.3f}x | {p.predicted:.3f}x |"
        )
    for mode in sorted({p.mode for p in found}):
        mine = sorted((p for p in found if p.mode == mode), key=lambda p: p.concurrency)
        batches = [p.concurrency for p in mine]
        measured = crossing(batches, [p.measured for p in mine])
        simulated = crossing(batches, [p.simulated for p in mine])
        predicted = crossing(batches, [p.predicted for p in mine])  # the cost model between the measured points
        interval = measured_interval(batches, [p.round_ratios for p in mine])
        spread, error = "", ""
        if interval is not None:
            low, high = (f"past {batches[-1]}" if math.isinf(end) else f"{end:.1f}" for end in interval)
            spread = f" (90 % of its rounds resampled: {low} to {high})"
        if measured is not None and simulated is not None:
            inside = ""
            if interval is not None:
                inside = "; inside that interval" if interval[0] <= simulated <= interval[1] else "; outside it"
            error = f" (simulated {100 * (simulated - measured) / measured:+.0f} %{inside})"
        lines.append(
            f"\n{mode}: break-even concurrency measured {_fmt(measured)}{spread}, simulated {_fmt(simulated)}{error}, "
            f"cost model alone {_fmt(predicted)} (between the same concurrencies)"
        )
    return "\n".join(lines)


def check(
    cost_model: Path, folders: Sequence[Path], acceptance_rate: float | None, draft_rate: float | None = None
) -> str:
    return table(points(cost_model, folders, acceptance_rate, draft_rate))
