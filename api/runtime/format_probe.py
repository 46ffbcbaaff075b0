"""`auto` weight formats, measured on this machine rather than guessed from its CPU flags.

At the first load on a machine, each candidate format (dtype x quantization, those `auto` leaves open) is loaded,
and then all of them are timed in turns (api/runtime/format_timing.py): round after round, each one's decode step on the
real model at 1, 4, 8, 16 and 32 rows and a 128-token prefill chunk, through the same runner and engine that serve
(api/runtime/format_steps.py). Each figure is the candidate's best time over the rounds, so another process's burst of
work, which slows some rounds, cannot pick the winner; while a calibration op says the machine is busy, more rounds
are timed. The format kept is the one whose worst ratio to the best time, at 1 row, 16 rows and the prefill chunk,
is smallest; for a quantised format the row count up to which its quantised weights run (above it, the dense copy)
is the largest measured count at which they beat the dense format of the same dtype, and every size when that is
the prefill chunk. (The prefill matters: on a CPU without native bf16, a dense bf16 prefill is an order of magnitude
slower than float32's, however fast int4 decodes.) An int4 format's steps are also timed on one int8 digit per
activation (int4_gemm, the same weights; `--int4-gemm auto`): they serve its large steps from the row count past
which they beat the dense copy, and the switch then compares its two-digit steps with those.

The choice is cached (api/runtime/format_choice.py) by the CPU (under BATCHSERVE_CPU_ISA), the kernel build, torch,
the model file and the candidates `auto` leaves open (not those that fit in the memory free at one start: a cached
choice that no longer fits is measured again among those that do), when it would still win with the runner-up's
figures lowered by their noise (a best over rounds can only be too slow, so the winner's own need no allowance);
else it is served and kept as provisional, measured again at the next start, and settled then: the same format, or,
where another leads inside its noise, the two tie and the one holding less memory. Inside that noise, the same int4
weights with bfloat16 activations are served where no scored size says they are slower (api/runtime/format_rule.py):
half the activations' memory. A later start re-times the calibration op and measures again when the machine's speed
no longer matches the cached one (another CPU with the same flags, or a VM slowed for hours), unless other processes
are using the CPU: a busy start keeps it. That measurement counts as the second one for the cached choice: the same
format, even by a lead inside the noise, is cached again at the new speed (else every later start would measure
again); another one inside its noise replaces it as provisional. The measurement is logged as a phase
(engine/phases.py: a line per candidate and round, where the choice is cached and how to redo it), after the kernels
it times are built.

Every candidate meets the quality bar (perplexity within 1 % of float32, docs/quantization.md): the table below
names the measured cost of each; a format whose quality is unmeasured is never a candidate.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from api.runtime.format_choice import (
    FormatChoice,
    cache_file,
    format_label,
    machine,
    one_digit_label,
    read_entry,
    write_entry,
)
from api.runtime.format_rule import candidates, choose, one_digit_allowed
from api.runtime.format_steps import (
    MEASURED_ROWS,
    PREFILL_ROWS,
    PROBE_ROWS,
    EngineStepper,
    Pair,
    available_memory,
    fitting,
    held_bytes,
    resident_groups,
)
from api.runtime.format_timing import (
    DEFAULT_PLAN,
    Calibration,
    Clock,
    LoadGauge,
    Recheck,
    RoundPlan,
    Rounds,
    Stepper,
    SystemClock,
    SystemLoad,
    default_calibration,
    merged_rounds,
    recheck,
    time_rounds,
)
from engine.phases import phase
from engine.platform.native import load_kernels
from engine.weights.checkpoints import checkpoint_dtype, convert_gguf, gguf_checkpoint_dir, parameter_count
from engine.weights.loader import LoadedModel, load_model, resolve_device, resolve_source, resolved_format

logger = logging.getLogger("batchserve.loader")


def decode_steps(plan: RoundPlan) -> int:
    """The decode steps one of a candidate's sequences takes in the rounds (a warm-up round, and per round a step
    that warms its weights and one per row count)."""
    return (len(PROBE_ROWS) + 1) * (plan.rounds + plan.max_extra_rounds + 1)


def measured_format(
    source: Path,
    pairs: list[Pair],
    device: str = "cpu",
    cache_dir: Path | None = None,
    prepare: Callable[[str, str], Stepper] | None = None,
    clock: Clock | None = None,
    calibration: Calibration | None = None,
    plan: RoundPlan = DEFAULT_PLAN,
    groups: Sequence[Sequence[Pair]] | None = None,
    reprobe: bool = False,
    load: LoadGauge | None = None,
    one_digit: bool = True,
    offered: Sequence[Pair] | None = None,
) -> FormatChoice:
    """The cached choice for this machine where there is one, it is among `pairs` and the machine's speed still
    matches it, else measured now, after building the kernels the candidates run (so that their build is a phase of
    its own rather than a silent part of the first candidate's). `prepare(dtype, quantization)`: one candidate, ready to
    time (default: loaded). `groups`: the candidates to hold loaded at once, in turn (default: all). `reprobe`: measure
    even where a choice is cached. `clock`, `calibration`, `load`: the system's, two tensor ops, /proc/stat.
    `one_digit`: time the int4 candidates' steps on one int8 digit too, for their large steps (`--int4-gemm auto`).
    `offered`: the candidates `auto` left open before memory ruled some out (default: `pairs`), which name the entry:
    a start with a little more or less memory free finds the one an earlier start cached rather than measuring again
    (a 3B model: 416 s), and serves it where it fits now."""
    cached = cache_file(source, list(offered or pairs), device, cache_dir, one_digit)
    redo = f"cached in {cached}; delete it to measure again (`batchserve formats` lists the choices)"
    clock = clock or SystemClock()
    calibration = calibration or default_calibration()
    if reprobe:
        cached.unlink(missing_ok=True)
    labels = [format_label(d, q) for d, q in pairs]
    entry = usable = read_entry(cached)
    if entry is not None and entry.choice.label not in labels:
        logger.info(
            "weights: the cached choice (%s) does not fit in the memory free now: measuring the candidates that do",
            entry.choice.label,
        )
        usable = None
    # A provisional entry is a previous start's lead inside its noise: measured again, and settled where both agree.
    pending = usable.choice if usable is not None and usable.choice.provisional else None
    previous = pending  # the measurement this one may confirm: a provisional choice, or one cached at another speed
    if pending is not None:
        logger.info("weights: the previous start's choice (%s) was provisional: measuring again", pending.summary())
    elif usable is not None:
        verdict, speeds = recheck(usable.choice.calibration_ms, clock, calibration, load=load or SystemLoad())
        if verdict is not Recheck.OTHER:
            busy = f", kept while other processes use the CPU ({speeds}); checked again at the next start"
            note = (busy if verdict is Recheck.BUSY else "") + f" ({redo})"
            logger.info(
                "weights: %s, chosen by auto, measured here %s%s", usable.choice.summary(), usable.measured_at, note
            )
            return usable.choice
        logger.info(
            "weights: the cached choice (%s, measured %s) was measured at another speed than this machine's now "
            "(%s): measuring again",
            usable.choice.label,
            usable.measured_at,
            speeds,
        )
        previous = usable.choice

    if groups is not None and len(groups) > 1:
        logger.info(
            "weights: the %d candidates do not fit in memory at once: timed in %d groups", len(pairs), len(groups)
        )
    load_kernels()  # the candidates' kernels, logged as their own phase when they build (engine/platform/native.py)
    if prepare is None:

        def load_and_prepare(dtype: str, quantization: str) -> Stepper:
            loaded = load_model(source, device, cache_dir, dtype, quantization, quiet=True, dense_reference=False)
            return EngineStepper(loaded, decode_steps=decode_steps(plan))

        prepare = load_and_prepare
    what = (
        f"{len(pairs)} candidates ({', '.join(labels)}), each loaded, then all timed in turns ({plan.rounds} rounds, "
        f"more while the machine is busy): decode steps of {'/'.join(map(str, PROBE_ROWS))} rows and a "
        f"{PREFILL_ROWS}-token prefill"
    )
    with phase(logger, "measuring weight formats once for this CPU", what, steps=len(pairs)) as running:
        measured: list[Rounds] = []

        def announce(number: int, planned: int) -> None:  # said as soon as the count grows past the plan
            running.step("the machine is busy: more rounds" if planned > plan.rounds else "", planned)

        loaded = 0
        for group in groups or [pairs]:
            running.stage("", len(pairs), loaded)
            steppers = _prepared(group, prepare, one_digit, running.step)
            loaded += len(group)
            running.stage("round", plan.rounds)
            measured.append(time_rounds(steppers, MEASURED_ROWS, clock, calibration, plan, announce))
            del steppers  # their engines and weight copies, before the next group loads
        best, spread = merged_rounds(measured, plan)
        quiet = sum(len(rounds.quiet()) for rounds in measured)
        total = sum(len(rounds.samples) for rounds in measured)
        all_calibrations = [cal for rounds in measured for cal in rounds.calibrations]
        choice = dataclasses.replace(
            choose(best, pairs, spread),
            rounds=total,
            quiet_rounds=quiet,
            calibration_ms=Rounds([], all_calibrations).calibration_ms(),
        )
        rounds_said = f"best of {total} rounds, {quiet} quiet"
        settled_by = ""  # why a lead inside its noise is cached all the same
        if choice.provisional and previous is not None and previous.label == choice.label:
            # Two measurements picked the same format, this one by a lead inside its noise: that is the evidence
            # one could not give, and measuring at every start would cost each start the probe's time.
            settled_by = " as by the previous measurement, this lead inside its noise: two measurements agree"
            choice = dataclasses.replace(choice, provisional=False)
        elif choice.provisional and pending is not None:
            # Two measurements in a row, each a lead inside its noise, picked different formats: on this machine they
            # tie. Measuring at every start would cost each start the probe's time for nothing (Zen 4 capped to VNNI
            # flipped between int4/float32 and int4/bfloat16 at 20-27 s a start): the one holding less memory settles.
            settled_by = (
                f": this measurement and the previous one ({pending.label}) each led inside their noise with another "
                "format, a tie on this machine, settled on the one that holds less memory"
            )
            choice = dataclasses.replace(min((choice, pending), key=_held_per_weight), provisional=False)
        if choice.provisional:
            kept = write_entry(cached, choice, str(source), machine(), keep_settled=True, read=entry).choice
            if not kept.provisional:  # another start (a concurrent `compare`, say) settled one while this measured
                logger.info("weights: %s, settled by another start while this one measured (%s)", kept.summary(), redo)
                running.result = redo
                return kept
            logger.info(
                "weights: %s, chosen by auto provisionally: the lead is inside the noise measured (%s; %s); kept as "
                "provisional, measured again at the next start and settled then",
                choice.summary(),
                rounds_said,
                choice.reason,
            )
            running.result = f"provisional in {cached}: measured again at the next start"
        else:
            write_entry(cached, choice, str(source), machine())
            logger.info(
                "weights: %s, chosen by auto%s (%s; %s)", choice.summary(), settled_by, rounds_said, choice.reason
            )
            running.result = redo
    return choice


def _held_per_weight(choice: FormatChoice) -> int:
    return held_bytes((choice.dtype, choice.quantization), 1)


def _prepared(
    group: Sequence[Pair], prepare: Callable[[str, str], Stepper], one_digit: bool, say: Callable[[str], object]
) -> dict[str, Stepper]:
    """The group's steppers by label, each int4 candidate's one-digit steps beside it where their quality allows.
    A function of its own so that its loop's names die with it: left bound in the caller, they held the group's last
    candidate (a 1B model's float32 copy: 12 GB) through the next group's load."""
    steppers: dict[str, Stepper] = {}
    for dtype, quantization in group:
        say(format_label(dtype, quantization))
        stepper = steppers[format_label(dtype, quantization)] = prepare(dtype, quantization)
        digit = stepper.one_digit() if one_digit and one_digit_allowed((dtype, quantization)) else None
        if digit is not None:  # the same weights' steps on one int8 digit: timed for the large steps
            steppers[one_digit_label(dtype, quantization)] = digit
    return steppers


def load_auto(
    path: str | Path | None = None,
    device: str = "cpu",
    cache_dir: Path | None = None,
    dtype: str = "auto",
    quantization: str = "auto",
    reprobe: bool = False,
    one_digit: bool = True,
) -> LoadedModel:
    """`load_model` for serving (no dense copy of what is quantised), with whatever is `auto` measured on a CPU where
    more than one candidate is left (`reprobe`: measured even where a choice is cached). Only the chosen format is
    loaded to serve: a cached choice is read before any weight is. A first start's slow steps are logged as phases,
    one after the other (engine/phases.py): the GGUF's conversion, the kernel build, the measurement and loading the
    weights (engine/platform/native.py builds the kernels before it times them). `one_digit`: measured_format's."""
    source = resolve_source(path)
    if source.is_file():
        convert_gguf(source, cache_dir)  # before the load's phase, not inside it
    measuring = "auto" in (dtype, quantization) and resolve_device(device).type == "cpu"
    pairs: list[Pair] = []
    if measuring:
        stored_float32 = source.is_dir() and checkpoint_dtype(source) in (None, torch.float32)
        loads_int4 = resolved_format(source, device, dtype, quantization).quantization == "int4"
        pairs = candidates(dtype, quantization, loads_int4, stored_float32)
    fit, weights, available = pairs, 0, None
    if len(pairs) > 1:  # sized only where there is a choice: a GGUF's checkpoint path hashes the whole file
        checkpoint = source if source.is_dir() else gguf_checkpoint_dir(source, cache_dir)
        weights, available = parameter_count(checkpoint), available_memory()
        fit = fitting(pairs, weights, available)
    if len(fit) < len(pairs):
        left_out = ", ".join(format_label(*pair) for pair in pairs if pair not in fit)
        gigabytes = (available or 0) / 1e9
        logger.info("weights: not measured, holding more than the %.1f GB available: %s", gigabytes, left_out)
    if len(fit) < 2:
        dtype, quantization = fit[0] if fit else (dtype, quantization)
        with phase(logger, "loading the weights", announce=False):
            return load_model(source, device, cache_dir, dtype, quantization, dense_reference=False)
    groups = resident_groups(fit, weights, available)
    choice = measured_format(
        source, fit, device, cache_dir, groups=groups, reprobe=reprobe, one_digit=one_digit, offered=pairs
    )
    with phase(logger, "loading the weights", announce=False):
        chosen = load_model(
            source, device, cache_dir, choice.dtype, choice.quantization, quiet=True, dense_reference=False
        )
    return chosen.with_row_switch(choice.max_quantized_rows, choice.min_gemm_rows)
