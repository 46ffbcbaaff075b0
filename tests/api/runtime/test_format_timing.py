"""Timing candidates in turns (api/runtime/format_timing.py) on a fake machine whose clock advances only by the work
timed on it (tests/api/runtime/fake_machine.py): rounds until enough are quiet, bounded; each figure its best round's;
a later start's calibration against the cached one."""

from __future__ import annotations

from functools import partial

import pytest

from api.runtime.format_timing import STALE_RATIO, Calibration, Recheck, RoundPlan, Rounds, recheck, time_rounds
from tests.api.runtime.fake_machine import FakeMachine

SIZES = (1, 16)
TRUTH = {"a": {1: 10.0, 16: 40.0}, "b": {1: 12.0, 16: 30.0}}


def approx(table: dict[str, dict[int, float]]) -> dict[str, object]:
    return {label: pytest.approx(sizes) for label, sizes in table.items()}


PLAN = RoundPlan(rounds=5, max_extra_rounds=6, busy_wait_s=0.5)


def test_a_quiet_machine_takes_the_planned_rounds_and_no_wait() -> None:
    machine = FakeMachine()
    steppers = {label: machine.stepper(times) for label, times in TRUTH.items()}
    announced: list[tuple[int, int]] = []
    rounds = time_rounds(steppers, SIZES, machine, machine.calibration(), PLAN, lambda *n: announced.append(n))
    assert len(rounds.samples) == 5 and rounds.quiet() == [0, 1, 2, 3, 4]
    assert announced == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]
    assert rounds.best_ms() == approx(TRUTH)
    assert all(
        spread == pytest.approx(0, abs=1e-9)
        for sizes in rounds.spread(PLAN.rounds).values()
        for spread in sizes.values()
    )
    assert rounds.calibration_ms() == pytest.approx({"compute": 1.0, "memory": 4.0})
    # a warm-up round, then per round a warming step and one per size: 3 steps each
    assert all(stepper.steps == len(SIZES) + 5 * (1 + len(SIZES)) for stepper in steppers.values())


def test_a_busy_spell_adds_rounds_and_waits_until_enough_are_quiet() -> None:
    machine = FakeMachine(busy=[(0.0, 2.0)])
    steppers = {label: machine.stepper(times) for label, times in TRUTH.items()}
    announced: list[tuple[int, int]] = []
    rounds = time_rounds(steppers, SIZES, machine, machine.calibration(), PLAN, lambda *n: announced.append(n))
    assert len(rounds.quiet()) == 5 and 5 < len(rounds.samples) <= 11
    assert announced[-1][1] == len(rounds.samples)  # the total announced grew with the busy rounds
    assert rounds.best_ms() == approx(TRUTH)  # the busy rounds' times are never the best
    assert rounds.calibration_ms() == pytest.approx({"compute": 1.0, "memory": 4.0})  # the busy calibrations left out


def test_a_memory_figure_that_flips_between_two_speeds_leaves_the_rounds_quiet() -> None:
    """A shared VM's memory bandwidth, quiet: the rounds are not busy while the compute op holds."""
    calibrations = [{"compute": 1.0, "memory": 4.0 if i % 3 else 8.0} for i in range(6)]
    rounds = Rounds([dict(TRUTH)] * 5, calibrations)
    assert rounds.quiet() == [0, 1, 2, 3, 4]
    busy = Rounds([dict(TRUTH)] * 5, [*calibrations[:3], {"compute": 3.0, "memory": 4.0}, *calibrations[4:]])
    assert busy.quiet() == [0, 1, 4]  # rounds 2 and 3 bracket the slow compute op


def test_a_machine_busy_throughout_stops_at_the_bound_and_reads_its_noise_over_every_round() -> None:
    machine = FakeMachine(busy_share=0.8, slot_s=0.05, seed=1)
    steppers = {label: machine.stepper(times) for label, times in TRUTH.items()}
    rounds = time_rounds(steppers, SIZES, machine, machine.calibration(), PLAN)
    assert len(rounds.samples) == 11 and len(rounds.quiet()) < 5
    assert max(spread for sizes in rounds.spread(PLAN.rounds).values() for spread in sizes.values()) > 1


def test_a_later_start_matches_the_cached_speed_unless_this_machine_is_another() -> None:
    cached = {"compute": 1.0, "memory": 4.0}
    same = FakeMachine()
    verdict, speeds = recheck(cached, same, same.calibration(), load=same)
    assert verdict is Recheck.SAME and speeds == "calibration compute 1.00 ms, memory 4.00 ms then, " + (
        "compute 1.00 ms, memory 4.00 ms now"
    )
    faster = FakeMachine(speed=0.5)  # contention never speeds a machine up: no second try
    assert recheck(cached, faster, faster.calibration(), load=faster)[0] is Recheck.OTHER and faster.t < 0.1
    busy_then_quiet = FakeMachine(busy=[(0.0, 0.1)])
    assert recheck(cached, busy_then_quiet, busy_then_quiet.calibration(), load=busy_then_quiet)[0] is Recheck.SAME
    slower = FakeMachine(speed=STALE_RATIO * 1.1)  # a quiet machine, slower throughout: another CPU
    assert recheck(cached, slower, slower.calibration(), tries=3, wait_s=0.5, load=slower)[0] is Recheck.OTHER
    assert slower.t >= 1.0  # it waited twice before calling it another machine


def test_the_memory_figure_alone_does_not_make_another_machine() -> None:
    """A shared VM's memory bandwidth moves 2x with its neighbours while the CPU stays: the same machine."""
    cached = {"compute": 1.0, "memory": 4.0}
    for memory_ms in (2.0, 8.0):
        machine = FakeMachine()
        calibration = Calibration({"compute": partial(machine.work, 1.0), "memory": partial(machine.work, memory_ms)})
        verdict, speeds = recheck(cached, machine, calibration, load=machine)
        assert verdict is Recheck.SAME and f"memory {memory_ms:.2f} ms now" in speeds


def test_a_later_start_on_a_busy_machine_keeps_the_cached_choice() -> None:
    """Slower throughout while other processes hold the cores: contention, not another machine (measuring now would
    time the contention). Without a load gauge the same calibrations read as another machine."""
    cached = {"compute": 1.0, "memory": 4.0}
    busy = FakeMachine(busy=[(0.0, 60.0)])
    assert recheck(cached, busy, busy.calibration(), load=busy)[0] is Recheck.BUSY
    unseen = FakeMachine(busy=[(0.0, 60.0)])
    assert recheck(cached, unseen, unseen.calibration())[0] is Recheck.OTHER
