"""Measure this machine's engine step time over a grid and fit the simulator's step-cost model to it.

    python -m benchmarks fit-cost --out cost.json [serve flags: --model PATH ...] [--batch-sizes 1,2,4,8,16,32,64] \
        [--prefill-tokens 0,32,128,512] [--contexts 32,256,1024] [--repeats 3]

The engine is built exactly as `serve` builds it (`api.runtime.build.build_model_runtime` with serve's model, device,
max-model-len and cpu-kernels flags). For each context length, `max(batch sizes)` sequences are prefilled to that
length (untimed); then each grid point times one `Engine.step`: the first B of them decoding one token each,
plus, for P > 0, a fresh P-token prompt prefilled in the same step, as continuous batching mixes them. Each point
is the median of --repeats timed steps after one warm-up step. The fitted form is documented in
`benchmarks.sim.cost.model`; cost.json holds it, its fit error, and every measured point. Beside it, a diagnostic:
how much slower each of the first 1-row decode steps after a prefill runs (`measure_after_large`).

Then, unless `--served-probes 0`, `benchmarks.sim.profiling.served_probe` starts `batchserve serve` with the same
engine flags and sends lone requests `--served-gap-s` apart: the served prefill after idle sets the prefill regime's
cold-step cost (served minus the fit's warm prediction), and the time a request spends outside the steps goes to
cost.json's
`served` section, which the simulator adds to every request's latency. Then twice as many lone requests beside one
long stream: how much longer a step runs when a request arrives during it, and how much longer such a request's
path outside the steps is (`served.busy_stall_s`, `busy_outside_s`).

And unless `--served-load-requests 0`, a load probe per mode (`--served-load-modes`): a burst through a real
server (`benchmarks.sim.profiling.served_probe.probe_load`), then the same requests through the same policy on
this process's engine alone (`benchmarks.sim.profiling.engine_replay`), back to back; what serving adds goes to
`served.load`, which the simulator charges on every step of that mode (`benchmarks.sim.cost.served`).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from api.config import RuntimeOptions
from api.flags import add_config_flags, config_from_args
from api.runtime.build import build_model_runtime, load
from benchmarks.results_io.machine import machine_facts
from benchmarks.sim.cost.files import save_fitted
from benchmarks.sim.cost.model import CostModel, FitReport, FittedCostModel, fit_cost_model
from benchmarks.sim.cost.served import (
    ServedStepExtra,
    served_load_json,
    served_load_modes,
    with_served_extra,
)
from benchmarks.sim.profiling.engine_replay import AloneReplay
from benchmarks.sim.profiling.refit import refit
from benchmarks.sim.profiling.served_probe import (
    LOAD_PROBE_ROW_TOKENS,
    ServedLoad,
    ServedProbe,
    probe,
    serve_argv,
)
from benchmarks.sim.profiling.steps import (
    COLD_IDLE_S,
    PREFILL_PROBE_TOKENS,
    ColdSteps,
    Grid,
    Point,
    after_large_probe_tokens,
    grid_kv_tokens,
    held_rows,
    load_policy,
    measure,
    measure_after_large,
    measure_cold,
    measure_served_load,
    rows_for,
    sequence_tokens,
    served_cold_steps,
    with_cold_steps,
)
from engine.engine import Engine
from engine.model.linear import RowSwitchedLinear
from engine.model.model_runner import TransformersRunner
from scheduler.config import Mode, SchedulerConfig

_DESCRIPTION = "Measure this machine's engine step time over a grid and fit the simulator's step-cost model."
NOT_ENGINE_FLAGS = ("mode", "host", "port", "api_key")  # the served probe sets these itself


def engine_flags(options: RuntimeOptions) -> str:
    """The options that shape the engine's speed, as `name=value` (a weight format too, where serve has one)."""
    skip = {"scheduler", "served_model_name", "kv_cache_tokens"}
    return ", ".join(f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options) if f.name not in skip)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    g = Grid()
    parser = argparse.ArgumentParser(prog="python -m benchmarks fit-cost", description=_DESCRIPTION)
    parser.add_argument("--out", type=Path, required=True, help="cost.json to write")
    parser.add_argument(
        "--refit",
        type=Path,
        metavar="COST_JSON",
        help="measure nothing: fit the current form to the points this cost.json measured (sim/profiling/refit.py)",
    )
    grid = parser.add_argument_group("grid")
    grid.add_argument("--batch-sizes", type=_ints, default=g.batch_sizes, help="decode rows per step")
    grid.add_argument("--prefill-tokens", type=_ints, default=g.prefill_tokens, help="prompt tokens per step")
    grid.add_argument("--contexts", type=_ints, default=g.contexts, help="context length of the decode rows")
    grid.add_argument("--repeats", type=int, default=g.repeats)
    grid.add_argument(
        "--draft-tokens",
        type=_non_negative,
        default=g.draft_tokens,
        help="drafts each row verifies at the verify points, one per batch size and context (0: none)",
    )
    grid.add_argument(
        "--cold-repeats",
        type=int,
        default=5,
        help=f"steps timed after {COLD_IDLE_S:g} s idle, per regime, for the cold-step cost (0: none)",
    )
    grid.add_argument(
        "--after-large-repeats",
        type=_non_negative,
        default=5,
        help=f"prefills of {PREFILL_PROBE_TOKENS} tokens, each followed by 1-row decodes timed by position: the"
        " quantised weights' transient after a step on the dense copy, a diagnostic (0: none)",
    )
    served = parser.add_argument_group("through a real server (0 requests: none)")
    counts = (
        (
            "--served-probes",
            8,
            "lone requests through a real `batchserve serve` for the served cold prefill and the time a request "
            "spends outside the steps, then twice as many beside a long stream for what arriving mid-step costs "
            "(0: the simulator then adds nothing)",
        ),
        (
            "--served-load-requests",
            48,
            "a burst of this many requests through a real server in each --served-load-modes, then the same "
            "requests on the engine alone, for what serving adds to each step",
        ),
        ("--served-load-seats", 8, "the load probe's seats"),
    )
    for flag, default, text in counts:
        served.add_argument(flag, type=int, default=default, help=text)
    served.add_argument("--served-gap-s", type=float, default=1.5, help="seconds between the served probe's requests")
    served.add_argument(
        "--served-load-modes",
        default="continuous",
        help="modes the load probe runs in (dynamic too: continuous,dynamic; the simulator charges only "
        "continuous unless told otherwise, see its --served-load-modes)",
    )
    # serve's own flags, generated from the same config: the engine is built as serve builds it (model, device,
    # max-model-len, cpu-kernels, and whatever weight format flags serve has). The grid sets the rows of the
    # engine-alone grid; serve's policy flags (batch timeout, token budget, queue) go to the served probes' servers
    # and the load probe's replay, and its HTTP flags are accepted and ignored.
    add_config_flags(parser, skip=("max_num_seqs", "kv_cache_tokens"))
    return parser


Load = tuple[ServedLoad, AloneReplay, ServedStepExtra]  # a load probe: the burst served, replayed alone, the extra


@dataclass(frozen=True)
class EngineSteps:
    """What the engine alone measured: the grid's points, the cold steps, the after-prefill transient."""

    points: list[Point]
    cold: ColdSteps
    after_large: tuple[float, ...]


def engine_options(served: RuntimeOptions, grid: Grid, load_seats: int, after_large_repeats: int) -> RuntimeOptions:
    """serve's options for the profile's own engine: continuous, the grid's rows, a KV cache that holds every probe."""
    return dataclasses.replace(
        served,
        scheduler=SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=held_rows(grid)),
        kv_cache_tokens=max(
            grid_kv_tokens(grid),
            load_seats * LOAD_PROBE_ROW_TOKENS,  # the load probe's replay: every seat's whole request
            after_large_probe_tokens(after_large_repeats) + PREFILL_PROBE_TOKENS + 32,  # two blocks' rounding
        ),
        enable_prefix_caching=False,  # the grid repeats its prompts: every probe must compute them
    )


def measure_engine(engine: Engine, grid: Grid, vocab: int, cold_repeats: int, after_large_repeats: int) -> EngineSteps:
    with torch.inference_mode():
        points = measure(engine, grid, vocab)
        cold = measure_cold(engine, vocab, 10**6, cold_repeats) if cold_repeats > 0 else ColdSteps(0.0, 0.0)
        after_large = (
            measure_after_large(engine, vocab, 2 * 10**6, after_large_repeats) if after_large_repeats > 0 else ()
        )
    return EngineSteps(points, cold, after_large)


def fit(engine: Engine, points: Sequence[Point], source: str) -> FitReport:
    """The step-cost fit; an engine that switches weights by step size (quantised ones up to max_quantized_rows)
    gets one fit per regime."""
    runner = engine.runner
    first = runner.layer_linears(runner.layers[0])[0] if isinstance(runner, TransformersRunner) else None
    switch = first.max_quantized_rows if isinstance(first, RowSwitchedLinear) else None
    return fit_cost_model([p.shape for p in points], [p.seconds for p in points], source, switch_tokens=switch)


def measure_served(
    engine: Engine, vocab: int, args: argparse.Namespace, served: RuntimeOptions, load_modes: Sequence[str]
) -> tuple[dict[str, Load], ServedProbe | None]:
    """Through real servers started with the engine's flags: the load probe of each mode, then the lone requests."""
    flags = serve_argv(args, skip=NOT_ENGINE_FLAGS)
    loads = {
        mode: measure_served_load(
            engine,
            vocab,
            flags,
            load_policy(served.scheduler, mode, args.served_load_seats),
            args.served_load_requests,
            args.out,
        )
        for mode in load_modes
    }
    if args.served_probes <= 0:
        return loads, None
    return loads, probe(flags, args.served_probes, args.served_gap_s, args.out.with_suffix(".serve.log"))


def cost_document(
    command: str,
    args: argparse.Namespace,
    served: RuntimeOptions,
    grid: Grid,
    seconds: float,
    engine_steps: EngineSteps,
    model: CostModel,
    loads: dict[str, Load],
    served_probe: ServedProbe | None,
) -> dict[str, Any]:
    """cost.json beside the fit: how it was measured, on what, and every measured point."""
    return {
        "command": command,
        "machine": {**machine_facts(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "engine": engine_flags(served),
        "grid": asdict(grid),
        "profile_seconds": seconds,
        "engine_cold_ms": {"decode": 1e3 * engine_steps.cold.decode_s, "prefill": 1e3 * engine_steps.cold.prefill_s},
        "engine_after_large_ms": [1e3 * t for t in engine_steps.after_large],
        "served": {
            **({} if served_probe is None else {**asdict(served_probe), "gap_s": args.served_gap_s}),
            "load": {mode: served_load_json(*measured) for mode, measured in loads.items()},
        },
        "points": [
            {
                "decode_rows": p.decode_rows,
                "prefill_tokens": p.prefill_tokens,
                "drafts": p.drafts,
                "context": p.context,
                "shape": asdict(p.shape),
                "measured_ms": 1e3 * p.seconds,
                "fitted_ms": 1e3 * model.step_time(p.shape),
            }
            for p in engine_steps.points
        ],
    }


def print_fit(report: FitReport) -> None:
    regimes = (
        [("", report.model)]
        if isinstance(report.model, FittedCostModel)
        else [(f"T <= {report.model.max_small_tokens}: ", report.model.small), ("longer: ", report.model.large)]
    )
    for name, m in regimes:
        print(
            f"fit: {name}t = {1e3 * m.const_s:.3f} ms + {1e3 * m.per_token_s:.4f} ms/token"
            f" + {1e3 * m.per_token_over_knee_s:.4f} ms/token over {m.knee_tokens} + {1e3 * m.per_seq_s:.4f} ms/seq"
            f" + {1e3 * m.per_attention_mpair_s:.3f} ms per M attention pairs"
            f" + {1e3 * m.per_sampled_s:.4f} ms/sampled position + {1e3 * m.per_kv_mtoken_s:.3f} ms per M KV tokens"
        )


def print_summary(
    report: FitReport,
    engine_steps: EngineSteps,
    cold: ColdSteps,
    loads: dict[str, Load],
    served_probe: ServedProbe | None,
    out: Path,
) -> None:
    print_fit(report)
    engine_cold = engine_steps.cold
    print(
        f"cold step (after {COLD_IDLE_S:g} s idle, engine alone): decode +{1e3 * engine_cold.decode_s:.2f} ms,"
        f" prefill +{1e3 * engine_cold.prefill_s:.2f} ms"
    )
    if engine_steps.after_large:
        shown = " ".join(f"+{1e3 * t:.2f}" for t in engine_steps.after_large)
        print(f"1-row decode after a {PREFILL_PROBE_TOKENS}-token prefill, by step: {shown} ms (diagnostic)")
    for mode, (burst, alone, over) in loads.items():
        print(
            f"served {mode} burst of {len(burst.trace)} at {burst.seats} seats: {burst.span_s:.2f} s served,"
            f" {alone.span_s:.2f} s on the engine alone ({alone.engine_s:.2f} s in {alone.steps} engine steps):"
            f" +{1e3 * over.const_s:.3f} ms a step, +{1e3 * over.per_row_s:.3f} ms a streamed token"
        )
    if served_probe is not None:
        print(
            f"served ({served_probe.count} lone requests, {served_probe.prompt_tokens}-token prompts):"
            f" prefill {1e3 * served_probe.prefill_s:.1f} ms (cold cost +{1e3 * cold.prefill_s:.2f} ms),"
            f" decode step {1e3 * served_probe.decode_step_s:.2f} ms,"
            f" outside the steps {1e3 * served_probe.outside_step_s:.2f} ms a request;"
            f" arriving mid-step: the step +{1e3 * served_probe.busy_stall_s:.2f} ms,"
            f" outside +{1e3 * served_probe.busy_outside_s:.2f} ms"
        )
    print_fit_error(report, out)


def print_fit_error(report: FitReport, out: Path) -> None:
    print(
        f"fit error: mean {100 * report.mean_abs_pct_error:.1f}%, max {100 * report.max_abs_pct_error:.1f}%,"
        f" R^2 {report.r_squared:.4f}; wrote {out}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = " ".join([sys.executable, "-m", "benchmarks", "fit-cost", *(argv or sys.argv[1:])])
    if args.refit is not None:
        try:
            report = refit(args.refit, args.out, command)
        except (OSError, ValueError) as exc:
            parser.error(f"--refit {args.refit}: {exc}")
        print_fit(report)
        print_fit_error(report, args.out)
        return 0
    try:
        grid = Grid(args.batch_sizes, args.prefill_tokens, args.contexts, args.repeats, args.draft_tokens)
        modes = served_load_modes(args.served_load_modes)
        if args.served_load_requests > 0 and not 1 <= args.served_load_seats < rows_for(grid):
            raise ValueError(f"--served-load-seats must be 1 to {rows_for(grid) - 1} (max of --batch-sizes)")
        served = config_from_args(args).runtime_options()
    except ValueError as exc:
        parser.error(str(exc))
    load_modes = modes if args.served_load_requests > 0 else ()
    options = engine_options(served, grid, args.served_load_seats if load_modes else 0, args.after_large_repeats)
    loaded = load(options)
    runtime = build_model_runtime(options, loaded)
    engine = runtime.engine
    if sequence_tokens(grid, max(grid.contexts)) > engine.max_model_len:
        parser.error(
            f"contexts plus {grid.tokens_per_context} tokens of steps exceed max-model-len {engine.max_model_len}"
        )
    if args.after_large_repeats > 0 and after_large_probe_tokens(args.after_large_repeats) > engine.max_model_len:
        parser.error(f"--after-large-repeats {args.after_large_repeats} needs a longer max-model-len")
    vocab = int(loaded.model.config.vocab_size)
    started = time.perf_counter()
    engine_steps = measure_engine(engine, grid, vocab, args.cold_repeats, args.after_large_repeats)
    source = (
        f"{runtime.model_name} on {platform.machine()}"
        + f", {torch.get_num_threads()} torch threads, {engine_flags(served)}"
    )
    report = fit(engine, engine_steps.points, source)
    loads, served_probe = measure_served(engine, vocab, args, served, load_modes)
    cold = engine_steps.cold
    if served_probe is not None:
        extras = {mode: extra for mode, (*_, extra) in loads.items()}
        cold = served_cold_steps(with_served_extra(report.model, extras, "continuous"), cold, served_probe)
    report = dataclasses.replace(report, model=with_cold_steps(report.model, cold))
    seconds = time.perf_counter() - started
    document = cost_document(command, args, served, grid, seconds, engine_steps, report.model, loads, served_probe)
    save_fitted(report, args.out, document)
    print_summary(report, engine_steps, cold, loads, served_probe, args.out)
    return 0
