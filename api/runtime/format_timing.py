"""Timing candidate weight formats so that another process cannot decide which one wins (api/runtime/format_probe.py).

Every candidate is loaded first, then timed in turns: round after round, each candidate's step at every size once
(A B C D, A B C D, ...), so a burst of another process's work slows a round of all of them rather than all the
steps of one; each figure is the candidate's best (fastest) time over the rounds, and its noise is how far its
median round lies above that best. A fixed pair of tensor ops (a compute-bound matmul and a memory-bound sum) is
timed before the first round and after each: a round bracketed by a calibration slower than the quietest one by
more than BUSY_RATIO ran on a busy machine, and until enough rounds were quiet the probe waits a moment and times
more rounds (a bounded number). The calibration's quiet time is kept with the choice: a later start times it again
to see whether this is still the machine the choice was measured on.

The clock is injectable (`Clock`), as are the candidates (`Stepper`) and the calibration's ops, so tests drive all
of this with a fake clock and bursts of fake contention.
"""

from __future__ import annotations

import enum
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

BUSY_RATIO = 1.25  # a calibration this much slower than the quietest: another process had the CPU
STALE_RATIO = 1.3  # a later start's calibration this far from the cached one (either way): another machine
# The calibration ops that judge the machine: busy rounds, another machine. Not "memory": on shared VMs its 64 MiB
# sum reads 1.0 or 2.0 ms for minutes at a time in a quiet process (measured, Zen 4), so judged by it quiet rounds
# counted as busy and a later start measured again at random. Another process on the cores slows the compute op.
DECIDING_OPS = frozenset({"compute"})
BUSY_CORES = 0.5  # other processes using this much CPU: a slower calibration is contention, not another machine


class Clock(Protocol):
    """Seconds from an arbitrary origin, and a wait."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Stepper(Protocol):
    """A candidate format, loaded and ready to time."""

    def step(self, size: int) -> None:
        """One engine step of `size` (a decode step's rows, or a prefill chunk's tokens), run to completion."""

    def one_digit(self) -> Stepper | None:
        """The same weights with every step on one int8 digit per activation (int4_gemm), or None where they have
        no such kernel (dense weights, a CPU without integer dot products)."""


def _timed_ms(clock: Clock, run: Callable[[], object]) -> float:
    started = clock.now()
    run()
    return (clock.now() - started) * 1000


@dataclass(frozen=True)
class Calibration:
    """Named tensor ops of fixed size, timed to tell how fast the machine is right now (each op's best of
    `repeats`)."""

    ops: Mapping[str, Callable[[], object]]
    repeats: int = 3

    def measure(self, clock: Clock) -> dict[str, float]:
        return {name: min(_timed_ms(clock, op) for _ in range(self.repeats)) for name, op in self.ops.items()}


def default_calibration() -> Calibration:
    """A float32 matmul (about 67 MFLOP: compute) and a sum over 64 MiB (more than most CPUs' last-level cache:
    memory), each run once here so that the timed runs find their pages touched."""
    left, right = torch.ones(128, 512), torch.ones(512, 512)
    big = torch.ones(16 * 1024 * 1024)
    ops: dict[str, Callable[[], object]] = {"compute": lambda: torch.mm(left, right), "memory": big.sum}
    with torch.inference_mode():
        for op in ops.values():
            op()
    return Calibration(ops)


@dataclass(frozen=True)
class RoundPlan:
    rounds: int = 5  # quiet rounds wanted: each candidate's step at every size timed this many times
    max_extra_rounds: int = 6  # more rounds while the machine is busy, at most
    busy_wait_s: float = 0.5  # after a busy round: give the other process a moment before the next


DEFAULT_PLAN = RoundPlan()


@dataclass(frozen=True)
class Rounds:
    """What the rounds measured: per round, per candidate label, per size, its step time (ms); the calibrations
    taken before the first round and after each (`calibrations[i]` and `[i + 1]` bracket round i)."""

    samples: Sequence[Mapping[str, Mapping[int, float]]]
    calibrations: Sequence[Mapping[str, float]]

    def quiet(self) -> list[int]:
        """The rounds whose bracketing calibrations were both within BUSY_RATIO of the quietest (DECIDING_OPS)."""
        calm = [
            all(cal[name] <= BUSY_RATIO * min(c[name] for c in self.calibrations) for name in DECIDING_OPS & cal.keys())
            for cal in self.calibrations
        ]
        return [i for i in range(len(self.samples)) if calm[i] and calm[i + 1]]

    def best_ms(self) -> dict[str, dict[int, float]]:
        """Each candidate's fastest time at each size, over every round (contention only ever adds time)."""
        return {
            label: {size: min(s[label][size] for s in self.samples) for size in sizes}
            for label, sizes in self.samples[0].items()
        }

    def spread(self, wanted: int) -> dict[str, dict[int, float]]:
        """Each figure's noise: its median over the quiet rounds (all rounds, when fewer than `wanted` were quiet)
        above its best, as a fraction of the best."""
        quiet = self.quiet()
        chosen = [self.samples[i] for i in quiet] if len(quiet) >= wanted else list(self.samples)
        best = self.best_ms()
        return {
            label: {size: statistics.median(s[label][size] for s in chosen) / ms - 1 for size, ms in sizes.items()}
            for label, sizes in best.items()
        }

    def calibration_ms(self) -> dict[str, float]:
        """The calibration's quiet time: the median of the calibrations within BUSY_RATIO of the quietest."""
        names = self.calibrations[0]
        quietest = {name: min(c[name] for c in self.calibrations) for name in names}
        return {
            name: statistics.median(c[name] for c in self.calibrations if c[name] <= BUSY_RATIO * quietest[name])
            for name in names
        }


def time_rounds(
    steppers: Mapping[str, Stepper],
    sizes: Sequence[int],
    clock: Clock,
    calibration: Calibration,
    plan: RoundPlan = DEFAULT_PLAN,
    on_round: Callable[[int, int], None] | None = None,
) -> Rounds:
    """Time each of `steppers` at each of `sizes`, in turns, until `plan.rounds` rounds were quiet or the extra
    rounds ran out. `on_round(number, planned)` is called as each round starts (`planned` grows past
    `plan.rounds` while the machine is busy)."""
    with torch.inference_mode():
        for stepper in steppers.values():  # a warm-up round: first steps build caches and touch pages
            for size in sizes:
                stepper.step(size)
        samples: list[dict[str, dict[int, float]]] = []
        calibrations = [calibration.measure(clock)]
        most = plan.rounds + plan.max_extra_rounds
        while True:
            quiet = len(Rounds(samples, calibrations).quiet())
            if quiet >= plan.rounds or len(samples) >= most:
                return Rounds(samples, calibrations)
            if on_round is not None:
                on_round(len(samples) + 1, min(len(samples) + plan.rounds - quiet, most))
            sample: dict[str, dict[int, float]] = {}
            for label, stepper in steppers.items():
                stepper.step(sizes[0])  # its own weights in cache, as after its previous step when it serves
                sample[label] = {}
                for size in sizes:
                    started = clock.now()
                    stepper.step(size)
                    sample[label][size] = (clock.now() - started) * 1000
            samples.append(sample)
            calibrations.append(calibration.measure(clock))
            if len(samples) - 1 not in Rounds(samples, calibrations).quiet():  # a busy round: wait a moment
                clock.sleep(plan.busy_wait_s)


def merged_rounds(
    measured: Sequence[Rounds], plan: RoundPlan
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """Each figure's best time and noise over the groups of candidates timed in turn."""
    best: dict[str, dict[int, float]] = {}
    spread: dict[str, dict[int, float]] = {}
    for rounds in measured:
        best |= rounds.best_ms()
        spread |= rounds.spread(plan.rounds)
    return best, spread


def calibration_text(calibration_ms: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {ms:.2f} ms" for name, ms in calibration_ms.items()) or "none"


class Recheck(enum.Enum):
    SAME = "same"  # this machine's speed matches the cached one: the choice stands
    OTHER = "other"  # faster or slower beyond STALE_RATIO on a quiet machine: another machine, measure again
    BUSY = "busy"  # slower while other processes use the cores: keep the choice, check again at the next start


def recheck(
    cached_ms: Mapping[str, float],
    clock: Clock,
    calibration: Calibration,
    tries: int = 3,
    wait_s: float = DEFAULT_PLAN.busy_wait_s,
    load: LoadGauge | None = None,
) -> tuple[Recheck, str]:
    """Whether this machine's calibration now is within STALE_RATIO of `cached_ms` (the one taken when a choice was
    measured) in the DECIDING_OPS, and both calibrations as text. Faster by more is another machine at once
    (contention only slows); slower may be a busy moment, so it is tried again after a wait, `tries` times in all;
    still slower while `load` sees other processes on the cores is a busy machine, not another one (measuring now
    would time the contention)."""
    now: dict[str, float] = {}
    verdict = Recheck.OTHER
    for attempt in range(tries):
        now = calibration.measure(clock)
        ratios = [now[name] / cached_ms[name] for name in now if name in DECIDING_OPS and cached_ms.get(name)]
        if not ratios or any(ratio < 1 / STALE_RATIO for ratio in ratios):
            break
        if all(ratio <= STALE_RATIO for ratio in ratios):
            verdict = Recheck.SAME
            break
        if attempt + 1 < tries:
            clock.sleep(wait_s)
    else:
        if load is not None and load.other_cores(clock) >= BUSY_CORES:
            verdict = Recheck.BUSY
    return verdict, f"calibration {calibration_text(cached_ms)} then, {calibration_text(now)} now"


class LoadGauge(Protocol):
    def other_cores(self, clock: Clock) -> float:
        """How many cores other processes kept busy over a short window just now."""
        ...


@dataclass(frozen=True)
class SystemLoad:
    """Other processes' CPU use from the kernel's counters (/proc/stat less this process's own time); 0 where the
    counters cannot be read (not Linux), which reads as a quiet machine."""

    window_s: float = 0.5

    def other_cores(self, clock: Clock) -> float:
        before = _cpu_seconds()
        clock.sleep(self.window_s)
        after = _cpu_seconds()
        if before is None or after is None:
            return 0.0
        (busy_then, own_then), (busy_now, own_now) = before, after
        return max(0.0, ((busy_now - busy_then) - (own_now - own_then)) / self.window_s)


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process spent busy, seconds this process spent), both since boot or start."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle and iowait
    own = os.times()
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system
