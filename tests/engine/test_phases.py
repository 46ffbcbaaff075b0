"""A first start's phases (engine/phases.py): a line as each starts, its steps, progress lines while it runs, and its
time and result when it ends; driven with a short beat, waiting for lines rather than for time."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from engine.phases import phase

LOGGER = logging.getLogger("batchserve.test_phases")


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER.name]


def wait_for(caplog: pytest.LogCaptureFixture, text: str) -> None:
    deadline = time.monotonic() + 60
    while not any(text in message for message in messages(caplog)):
        assert time.monotonic() < deadline, f"no line with {text!r}: {messages(caplog)}"
        time.sleep(0.01)


def test_a_phase_logs_its_start_steps_progress_and_end_with_its_result(caplog: pytest.LogCaptureFixture) -> None:
    before = set(threading.enumerate())
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        with phase(LOGGER, "measuring things", "2 of them", steps=2, every_s=0.01) as running:
            running.step("first")
            wait_for(caplog, "1 of 2 (first), ")
            running.step("second")
            wait_for(caplog, "2 of 2 (second), ")
            running.result = "cached in /x; delete it to measure again"
        # No progress line after the end: the phase's beat thread is joined before it returns, so none can follow.
        assert [t for t in threading.enumerate() if t not in before and t.name == "batchserve-progress"] == []
        ended = len(messages(caplog))
    lines = messages(caplog)
    assert lines[0] == "measuring things, 2 of them"
    assert lines[1] == "measuring things: 1 of 2 (first)"
    assert "measuring things: 2 of 2 (second)" in lines
    progress = [line for line in lines if line.endswith(" s so far")]
    assert progress and all(line.startswith("measuring things: ") for line in progress)
    assert lines[-1].startswith("measuring things: done in ")
    assert lines[-1].endswith(" s; cached in /x; delete it to measure again")
    assert len(lines) == ended


def test_an_unannounced_phase_speaks_only_when_it_runs_long_and_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        with phase(LOGGER, "loading a cached thing", announce=False):
            pass
        with phase(LOGGER, "rebuilding it", announce=False, every_s=0.01):
            wait_for(caplog, "rebuilding it: 0 s so far")
    lines = messages(caplog)
    assert lines[0].startswith("loading a cached thing: done in ") and lines[0].endswith(" s")
    assert lines[-1].startswith("rebuilding it: done in ")


def test_a_phase_that_raises_says_it_stopped_and_raises(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.INFO, logger=LOGGER.name),
        pytest.raises(RuntimeError, match="no compiler"),
        phase(LOGGER, "building"),
    ):
        raise RuntimeError("no compiler")
    lines = messages(caplog)
    assert lines[0] == "building" and lines[-1].startswith("building: stopped after ")


def test_a_phase_can_count_a_second_kind_of_step_and_raise_its_total(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER.name), phase(LOGGER, "timing", steps=1) as running:
        running.step("loading")
        running.stage("round", 2)
        running.step()
        running.step("busy: more rounds", steps=3)
    lines = messages(caplog)
    assert lines[1:4] == [
        "timing: 1 of 1 (loading)",
        "timing: round 1 of 2",
        "timing: round 2 of 3 (busy: more rounds)",
    ]
