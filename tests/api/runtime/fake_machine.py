"""A fake machine for the format probe (api/runtime/format_timing.py, api/runtime/format_probe.py): a clock that
advances only by the work timed on it, so no test depends on real timings. Each op costs its quiet time x `speed`, BURST
times that while another process is busy (seeded random slots of the fake timeline, or given windows), and up to
`jitter` more at random."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from api.runtime.format_timing import Calibration

BURST = 10.0  # another process on the CPU: ten times as long


class FakeMachine:
    def __init__(
        self,
        speed: float = 1.0,
        busy_share: float = 0.0,
        slot_s: float = 0.5,
        busy: Sequence[tuple[float, float]] = (),
        jitter: float = 0.0,
        seed: int = 0,
        cores: int = 2,
    ) -> None:
        self.t = 0.0
        self.cores = cores
        self.speed = speed
        self.busy_share = busy_share
        self.slot_s = slot_s
        self.busy = busy
        self.jitter = jitter
        self.seed = seed
        self.rng = random.Random(seed)
        self.bursts = 0  # ops that ran while busy

    # the Clock protocol
    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def busy_at(self, t: float) -> bool:
        if any(start <= t < end for start, end in self.busy):
            return True
        slot = int(t / self.slot_s)
        return self.busy_share > 0 and random.Random(self.seed * 1_000_003 + slot).random() < self.busy_share

    def work(self, ms: float) -> None:
        busy = self.busy_at(self.t)
        self.bursts += busy
        factor = self.speed * (BURST if busy else 1.0) * (1 + self.jitter * self.rng.random())
        self.t += ms * factor / 1000

    # the LoadGauge protocol: a busy slot of the timeline is another process on every core
    def other_cores(self, clock: object) -> float:
        return float(self.cores) if self.busy_at(self.t) else 0.0

    def calibration(self) -> Calibration:
        return Calibration({"compute": lambda: self.work(1.0), "memory": lambda: self.work(4.0)})

    def stepper(self, times: Mapping[int, float], one_digit: Mapping[int, float] | None = None) -> FakeStepper:
        return FakeStepper(self, times, one_digit)


class FakeStepper:
    """A candidate whose step at each size takes its quiet time (ms) on `machine`; `one_digit`: its one-digit
    steps' times, where it has them."""

    def __init__(
        self, machine: FakeMachine, times: Mapping[int, float], one_digit: Mapping[int, float] | None = None
    ) -> None:
        self.machine = machine
        self.times = times
        self.one_digit_times = one_digit
        self.steps = 0

    def one_digit(self) -> FakeStepper | None:
        return None if self.one_digit_times is None else FakeStepper(self.machine, self.one_digit_times)

    def step(self, size: int) -> None:
        self.steps += 1
        self.machine.work(self.times[size])
