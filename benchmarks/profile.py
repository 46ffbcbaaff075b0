"""Measure this machine's engine step time over a grid and fit the simulator's step-cost model to it.

    python -m benchmarks.profile --out cost.json [serve flags: --model PATH ...] [--batch-sizes 1,2,4,8,16,32,64] \
        [--prefill-tokens 0,32,128,512] [--contexts 32,256,1024] [--repeats 3]

The engine is built exactly as `serve` builds it (`api.runtime.build.build_model_runtime` with serve's model, device,
max-model-len and cpu-kernels flags). For each context length, `max(batch sizes)` sequences are prefilled to that
length (untimed); then each grid point times one `Engine.step`: the first B of them decoding one token each,
plus, for P > 0, a fresh P-token prompt prefilled in the same step, as continuous batching mixes them. Each point
is the median of --repeats timed steps after one warm-up step. The fitted form is documented in
`benchmarks.cost_model`; cost.json holds it, its fit error, and every measured point. Beside it, a diagnostic:
how much slower each of the first 1-row decode steps after a prefill runs (`measure_after_large`).

Then, unless `--served-probes 0`, `benchmarks.served_probe` starts `batchserve serve` with the same engine flags and
sends lone requests `--served-gap-s` apart: the served prefill after idle sets the prefill regime's cold-step cost
(served minus the fit's warm prediction), and the time a request spends outside the steps goes to cost.json's
`served` section, which the simulator adds to every request's latency. Then twice as many lone requests beside one
long stream: how much longer a step runs when a request arrives during it, and how much longer such a request's
path outside the steps is (`served.busy_stall_s`, `busy_outside_s`).

And unless `--served-load-requests 0`, a load probe per mode (`--served-load-modes`): a burst through a real
server (`benchmarks.served_probe.probe_load`), then the same requests through the same policy on this process's
engine alone (`benchmarks.engine_replay`), back to back; what serving adds goes to `served.load`, which the
simulator charges on every step of that mode (`benchmarks.served_cost`).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from api.config import RuntimeOptions
from api.flags import add_config_flags, config_from_args
from api.runtime.build import build_model_runtime, load
from benchmarks.cost_model import (
    CostModel,
    FittedCostModel,
    StepShape,
    SwitchedCostModel,
    chunk_attention_pairs,
    fit_cost_model,
    save_fitted,
)
from benchmarks.engine_replay import AloneReplay, replay_alone
from benchmarks.machine import machine_facts
from benchmarks.served_cost import (
    ServedStepExtra,
    served_extra,
    served_load_json,
    served_load_modes,
    with_served_extra,
)
from benchmarks.served_probe import LOAD_PROBE_ROW_TOKENS, ServedLoad, ServedProbe, probe, probe_load, serve_argv
from engine.engine import Engine
from engine.linear import RowSwitchedLinear
from engine.model_runner import TransformersRunner
from engine.sampling_params import SamplingParams
from scheduler.config import Mode, SchedulerConfig

_DESCRIPTION = "Measure this machine's engine step time over a grid and fit the simulator's step-cost model."
# The first decode steps after a step on the dense copy run slower while the quantised weights come back into the
# caches (on the 2-core Xeon a 1-row decode runs +1.0-1.8 ms slow right after a 40-token prefill, +0.6-1.1 ms
# two steps later, settled by the 6th-8th). The grid's decode points are timed 2-4 steps after one, inside that
# transient, which is nearer a served decode than the settled cost is: timed settled, the simulator ran fast
# (docs/simulator.md, "Tried and not kept").
AFTER_LARGE_STEPS = 8  # positions of the transient that measure_after_large reports
AFTER_LARGE_SETTLED = 10  # ... against the decode steps from this position on
AFTER_LARGE_PROMPT_TOKENS = 32  # the probe's decoder's context


@dataclass(frozen=True)
class Grid:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_tokens: tuple[int, ...] = (0, 32, 128, 512)
    contexts: tuple[int, ...] = (32, 256, 1024)
    repeats: int = 3

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 0 or max(self.batch_sizes) < 1:
            raise ValueError("batch sizes must be >= 0, at least one positive")
        if not self.prefill_tokens or min(self.prefill_tokens) < 0:
            raise ValueError("prefill tokens must be >= 0")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError("contexts must be >= 1")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")

    @property
    def steps_per_context(self) -> int:
        """Decode steps each sequence may take at one context: warm-up plus repeats, per grid point."""
        return len(self.batch_sizes) * len(self.prefill_tokens) * (self.repeats + 1)


@dataclass(frozen=True)
class Point:
    decode_rows: int
    prefill_tokens: int
    context: int
    shape: StepShape
    seconds: float


def step_shape(engine: Engine, schedule: Sequence[tuple[int, int]]) -> StepShape:
    """The cost model's view of a step, from the engine's state before it (as `SimEngine.step` computes it)."""
    num_tokens = attention = kv_tokens = sampled = 0
    for seq_id, count in schedule:
        computed = engine.num_computed(seq_id)
        num_tokens += count
        attention += chunk_attention_pairs(computed, count)
        kv_tokens += computed + count
        sampled += int(engine.num_pending(seq_id) == count)
    return StepShape(len(schedule), num_tokens, sampled, attention, kv_tokens)


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (length,), generator=generator).tolist()


def _prefill(engine: Engine, seq_id: int, budget: int = 512) -> None:
    while engine.num_pending(seq_id) > 1:
        engine.step([(seq_id, min(budget, engine.num_pending(seq_id) - 1))])  # leave one: decodes sample


def measure(engine: Engine, grid: Grid, vocab: int) -> list[Point]:
    points: list[Point] = []
    rows = max(grid.batch_sizes)
    extra = grid.steps_per_context + 2  # decode steps a sequence takes at one context, and a margin
    next_id = 0
    for context in grid.contexts:
        decoders = list(range(next_id, next_id + rows))
        next_id += rows
        params = SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True)  # never reached
        for seq_id in decoders:
            engine.add(seq_id, _prompt(context, vocab, seq_id), params)
            if not engine.reserve(seq_id, context + extra):
                raise ValueError(f"the KV cache cannot hold {rows} sequences of {context + extra} tokens")
            _prefill(engine, seq_id)
        for batch in grid.batch_sizes:
            for prefill in grid.prefill_tokens:
                if batch == 0 and prefill == 0:
                    continue
                times, shape = [], None
                for repeat in range(grid.repeats + 1):
                    schedule = [(s, engine.num_pending(s)) for s in decoders[:batch]]
                    if prefill:
                        fresh, next_id = next_id, next_id + 1
                        prefill_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                        engine.add(fresh, _prompt(prefill, vocab, fresh), prefill_params)
                        if not engine.reserve(fresh, prefill + 1):
                            raise ValueError("the KV cache is too small for the grid; lower --batch-sizes")
                        schedule.append((fresh, prefill))
                    shape = step_shape(engine, schedule)
                    start = time.perf_counter()
                    engine.step(schedule)
                    elapsed = time.perf_counter() - start
                    if prefill:
                        engine.remove(fresh)
                    if repeat:  # the first is a warm-up
                        times.append(elapsed)
                assert shape is not None
                point = Point(batch, prefill, context, shape, statistics.median(times))
                points.append(point)
                print(
                    f"context {context:5d}  decode rows {batch:3d}  prefill {prefill:4d}:"
                    f" {1e3 * point.seconds:8.2f} ms",
                    file=sys.stderr,
                )
        for seq_id in decoders:
            engine.remove(seq_id)
    return points


@dataclass(frozen=True)
class ColdSteps:
    """A lone step's extra cost after the engine sat idle, per regime: a 1-row decode (the quantised weights
    where the engine switches) and a `PREFILL_PROBE_TOKENS`-token prefill (the dense copy)."""

    decode_s: float
    prefill_s: float


_NOT_ENGINE_FLAGS = ("mode", "host", "port", "api_key")  # the served probe sets these itself
PREFILL_PROBE_TOKENS = 40  # a typical short prompt of the mixed workload
COLD_IDLE_S = 1.0  # well past COLD_AFTER_S, as between requests at light load


def _add_decoder(engine: Engine, vocab: int, seq_id: int, prompt_tokens: int, max_tokens: int, probe: str) -> None:
    """A probe's decoding sequence: its prompt prefilled (all but the token its first decode samples from)."""
    engine.add(seq_id, _prompt(prompt_tokens, vocab, seq_id), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    if not engine.reserve(seq_id, prompt_tokens + max_tokens):
        raise ValueError(f"the KV cache is too small for the {probe}")
    _prefill(engine, seq_id)


def _timed_prefill(
    engine: Engine, vocab: int, seq_id: int, probe: str, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds of one `PREFILL_PROBE_TOKENS`-token prefill step (more tokens than the switch: the dense copy);
    the sequence is gone again afterwards, whatever happened."""
    engine.add(seq_id, _prompt(PREFILL_PROBE_TOKENS, vocab, seq_id), SamplingParams(max_tokens=1, ignore_eos=True))
    try:
        if not engine.reserve(seq_id, PREFILL_PROBE_TOKENS + 1):
            raise ValueError(f"the KV cache is too small for the {probe}")
        start = clock()
        engine.step([(seq_id, PREFILL_PROBE_TOKENS)])
        return clock() - start
    finally:
        engine.remove(seq_id)


def measure_cold(engine: Engine, vocab: int, first_id: int, repeats: int) -> ColdSteps:
    """Median step time after `COLD_IDLE_S` of sleep minus the median of the same step run back to back."""
    decoder = first_id
    _add_decoder(engine, vocab, decoder, 32, 4 * repeats + 16, "cold-step probe")
    fresh = iter(range(first_id + 1, first_id + 1 + 4 * repeats))

    def decode_step() -> float:
        start = time.perf_counter()
        engine.step([(decoder, engine.num_pending(decoder))])
        return time.perf_counter() - start

    def prefill_step() -> float:
        return _timed_prefill(engine, vocab, next(fresh), "cold-step probe")

    def penalty(step: Callable[[], float]) -> float:
        step()  # warm-up
        warm = statistics.median(step() for _ in range(repeats))
        cold = []
        for _ in range(repeats):
            time.sleep(COLD_IDLE_S)
            cold.append(step())
        return max(0.0, statistics.median(cold) - warm)

    try:
        return ColdSteps(decode_s=penalty(decode_step), prefill_s=penalty(prefill_step))
    finally:
        engine.remove(decoder)


def after_large_probe_tokens(repeats: int) -> int:
    """The tokens `measure_after_large`'s decoder holds by its end: its prompt and every decode step it takes."""
    return AFTER_LARGE_PROMPT_TOKENS + repeats * (AFTER_LARGE_SETTLED + AFTER_LARGE_STEPS) + 1


def measure_after_large(
    engine: Engine, vocab: int, first_id: int, repeats: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, ...]:
    """Extra seconds of each of the first `AFTER_LARGE_STEPS` 1-row decode steps after a `PREFILL_PROBE_TOKENS`
    prefill step over the same decode's steps `AFTER_LARGE_SETTLED` to `AFTER_LARGE_SETTLED + AFTER_LARGE_STEPS`:
    each position is the median over `repeats` prefills, the reference the median of its positions. A diagnostic
    (cost.json's `engine_after_large_ms`), not part of the fitted model."""
    if repeats < 1:
        raise ValueError(f"the after-prefill probe needs at least one prefill, got {repeats}")
    timed_steps = AFTER_LARGE_SETTLED + AFTER_LARGE_STEPS  # after each prefill: the transient, then its reference
    decoder = first_id
    max_tokens = after_large_probe_tokens(repeats) - AFTER_LARGE_PROMPT_TOKENS
    by_position: list[list[float]] = [[] for _ in range(timed_steps)]
    try:
        _add_decoder(engine, vocab, decoder, AFTER_LARGE_PROMPT_TOKENS, max_tokens, "after-prefill probe")
        for prefill_id in range(first_id + 1, first_id + 1 + repeats):
            _timed_prefill(engine, vocab, prefill_id, "after-prefill probe", clock)
            for position in range(timed_steps):
                start = clock()
                engine.step([(decoder, engine.num_pending(decoder))])
                by_position[position].append(clock() - start)
    finally:  # removing a sequence that is gone already (or never came) is a no-op
        engine.remove(decoder)
    by_position_median = [statistics.median(times) for times in by_position]  # a slow prefill's run drops out
    settled = statistics.median(by_position_median[AFTER_LARGE_SETTLED:])
    return tuple(max(0.0, t - settled) for t in by_position_median[:AFTER_LARGE_STEPS])


def served_cold_steps(model: CostModel, engine_cold: ColdSteps, served: ServedProbe) -> ColdSteps:
    """The prefill's cold cost as served: the served lone prefill minus the model's warm time for that prompt
    (the fit plus, where measured, the served continuous step's extra)."""
    tokens = served.prompt_tokens
    lone = StepShape(1, tokens, 1, chunk_attention_pairs(0, tokens), tokens)
    return ColdSteps(decode_s=engine_cold.decode_s, prefill_s=max(0.0, served.prefill_s - model.step_time(lone)))


def with_cold_steps(model: FittedCostModel | SwitchedCostModel, cold: ColdSteps) -> FittedCostModel | SwitchedCostModel:
    if isinstance(model, SwitchedCostModel):
        small = dataclasses.replace(model.small, cold_step_s=cold.decode_s)
        return dataclasses.replace(
            model, small=small, large=dataclasses.replace(model.large, cold_step_s=cold.prefill_s)
        )
    return dataclasses.replace(model, cold_step_s=cold.prefill_s)  # at light load a cold step is a new prompt's


def _engine_flags(options: RuntimeOptions) -> str:
    """The options that shape the engine's speed, as `name=value` (a weight format too, where serve has one)."""
    skip = {"scheduler", "served_model_name", "kv_cache_tokens"}
    return ", ".join(f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options) if f.name not in skip)


def measure_served_load(
    engine: Engine, vocab: int, flags: Sequence[str], policy: SchedulerConfig, count: int, out: Path
) -> tuple[ServedLoad, AloneReplay, ServedStepExtra]:
    """A burst through a real server with `policy` (its mode and seats), then the same requests through the same
    policy on this process's engine alone."""
    mode, seats = policy.mode.value, policy.seats
    burst = probe_load(flags, mode, seats, count, out.with_suffix(f".serve-{mode}.log"))
    with torch.inference_mode():
        alone = replay_alone(engine, burst.trace, policy, vocab)
    return burst, alone, served_extra(burst, alone)


def load_policy(policy: SchedulerConfig, mode: str, seats: int) -> SchedulerConfig:
    """serve's policy flags as given, in `mode`, with `seats` seats."""
    return dataclasses.replace(policy, mode=Mode(mode), max_batch_size=seats, max_num_seqs=seats)


def rows_for(grid: Grid) -> int:
    """Rows the profile's engine holds: the grid's largest batch plus its fresh prefill."""
    return max(grid.batch_sizes) + 1


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    g = Grid()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=_DESCRIPTION)
    parser.add_argument("--out", type=Path, required=True, help="cost.json to write")
    grid = parser.add_argument_group("grid")
    grid.add_argument("--batch-sizes", type=_ints, default=g.batch_sizes, help="decode rows per step")
    grid.add_argument("--prefill-tokens", type=_ints, default=g.prefill_tokens, help="prompt tokens per step")
    grid.add_argument("--contexts", type=_ints, default=g.contexts, help="context length of the decode rows")
    grid.add_argument("--repeats", type=int, default=g.repeats)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        grid = Grid(args.batch_sizes, args.prefill_tokens, args.contexts, args.repeats)
        modes = served_load_modes(args.served_load_modes)
        if args.served_load_requests > 0 and not 1 <= args.served_load_seats < rows_for(grid):
            raise ValueError(f"--served-load-seats must be 1 to {rows_for(grid) - 1} (max of --batch-sizes)")
    except ValueError as exc:
        parser.error(str(exc))
    rows = rows_for(grid)
    load_modes = modes if args.served_load_requests > 0 else ()
    load_seats = args.served_load_seats if load_modes else 0
    per_row = max(grid.contexts) + grid.steps_per_context + 4  # a sequence's whole length (measure's)
    try:
        served = config_from_args(args).runtime_options()
    except ValueError as exc:
        parser.error(str(exc))
    options = dataclasses.replace(
        served,
        scheduler=SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=rows),
        kv_cache_tokens=max(
            rows * (max(per_row, max(grid.prefill_tokens) + 1) + 16),  # + a block of rounding
            load_seats * LOAD_PROBE_ROW_TOKENS,  # the load probe's replay: every seat's whole request
            after_large_probe_tokens(args.after_large_repeats) + PREFILL_PROBE_TOKENS + 32,  # two blocks' rounding
        ),
    )
    loaded = load(options)
    runtime = build_model_runtime(options, loaded)
    engine = runtime.engine
    if per_row > engine.max_model_len:
        parser.error(f"contexts plus {grid.steps_per_context} decode steps exceed max-model-len {engine.max_model_len}")
    if args.after_large_repeats > 0 and after_large_probe_tokens(args.after_large_repeats) > engine.max_model_len:
        parser.error(f"--after-large-repeats {args.after_large_repeats} needs a longer max-model-len")
    vocab = int(loaded.model.config.vocab_size)
    started = time.perf_counter()
    with torch.inference_mode():
        points = measure(engine, grid, vocab)
        cold = measure_cold(engine, vocab, 10**6, args.cold_repeats) if args.cold_repeats > 0 else ColdSteps(0.0, 0.0)
        after_large = (
            measure_after_large(engine, vocab, 2 * 10**6, args.after_large_repeats)
            if args.after_large_repeats > 0
            else ()
        )
    source = (
        f"{runtime.model_name} on {platform.machine()}"
        + f", {torch.get_num_threads()} torch threads, {_engine_flags(served)}"
    )
    # An engine that switches weights by step size (quantised ones up to max_quantized_rows) gets one fit per regime.
    runner = engine.runner
    first = runner.layer_linears(runner.layers[0])[0] if isinstance(runner, TransformersRunner) else None
    switch = first.max_quantized_rows if isinstance(first, RowSwitchedLinear) else None
    report = fit_cost_model([p.shape for p in points], [p.seconds for p in points], source, switch_tokens=switch)
    served_probe: ServedProbe | None = None
    engine_cold = cold
    flags = serve_argv(args, skip=_NOT_ENGINE_FLAGS)
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
    extras = {mode: extra for mode, (*_, extra) in loads.items()}
    if args.served_probes > 0:
        served_probe = probe(flags, args.served_probes, args.served_gap_s, args.out.with_suffix(".serve.log"))
        cold = served_cold_steps(with_served_extra(report.model, extras, "continuous"), cold, served_probe)
    report = dataclasses.replace(report, model=with_cold_steps(report.model, cold))
    extra = {
        "command": " ".join([sys.executable, "-m", "benchmarks.profile", *(argv or sys.argv[1:])]),
        "machine": {**machine_facts(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "engine": _engine_flags(served),
        "grid": asdict(grid),
        "profile_seconds": time.perf_counter() - started,
        "engine_cold_ms": {"decode": 1e3 * engine_cold.decode_s, "prefill": 1e3 * engine_cold.prefill_s},
        "engine_after_large_ms": [1e3 * t for t in after_large],
        "served": {
            **({} if served_probe is None else {**asdict(served_probe), "gap_s": args.served_gap_s}),
            "load": {mode: served_load_json(*measured) for mode, measured in loads.items()},
        },
        "points": [
            {
                "decode_rows": p.decode_rows,
                "prefill_tokens": p.prefill_tokens,
                "context": p.context,
                "shape": asdict(p.shape),
                "measured_ms": 1e3 * p.seconds,
                "fitted_ms": 1e3 * report.model.step_time(p.shape),
            }
            for p in points
        ],
    }
    save_fitted(report, args.out, extra)
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
        )
    print(
        f"cold step (after {COLD_IDLE_S:g} s idle, engine alone): decode +{1e3 * engine_cold.decode_s:.2f} ms,"
        f" prefill +{1e3 * engine_cold.prefill_s:.2f} ms"
    )
    if after_large:
        shown = " ".join(f"+{1e3 * t:.2f}" for t in after_large)
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
    print(
        f"fit error: mean {100 * report.mean_abs_pct_error:.1f}%, max {100 * report.max_abs_pct_error:.1f}%,"
        f" R^2 {report.r_squared:.4f}; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
