"""--policy MODULE:CLASS: loading a policy by import path, and the shipped example (shortest prompt first, with
aging) pinned to the fake clock."""

from __future__ import annotations

import pytest

from scheduler.config import Mode, SchedulerConfig
from scheduler.examples.shortest_prompt_first import AGING_TOKENS_PER_S, ShortestPromptFirst
from scheduler.policies import load_policy
from tests.fakes import FakeClock, assert_complete, assert_drained, build

EXAMPLE = "scheduler.examples.shortest_prompt_first:ShortestPromptFirst"


def test_a_policy_loads_by_import_path_and_bad_paths_are_named() -> None:
    assert load_policy(EXAMPLE) is ShortestPromptFirst
    with pytest.raises(ValueError, match="No module named"):
        load_policy("no_such_module:Policy")
    with pytest.raises(ValueError, match="not a subclass"):
        load_policy("scheduler.config:SchedulerConfig")
    with pytest.raises(ValueError, match="MODULE:CLASS"):
        SchedulerConfig(policy="scheduler.examples.shortest_prompt_first")


def test_the_shortest_waiting_prompt_joins_first() -> None:
    h = build(Mode.CONTINUOUS, seats=1, policy=EXAMPLE)
    assert isinstance(h.scheduler.policy, ShortestPromptFirst)
    h.submit(prompt=4, max_tokens=3)
    h.step()  # holds the one seat
    long, short = h.submit(prompt=40, max_tokens=2), h.submit(prompt=4, max_tokens=2)
    h.run()
    assert short.token_steps[0] < long.token_steps[0]
    for stream in (long, short):
        assert_complete(stream)
    assert_drained(h)


def test_a_long_prompt_that_waited_long_enough_overtakes_by_aging() -> None:
    h = build(Mode.CONTINUOUS, seats=1, policy=EXAMPLE, step_time=0.01)
    h.submit(prompt=4, max_tokens=40)
    h.step()
    long = h.submit(prompt=40, max_tokens=2)
    assert isinstance(h.clock, FakeClock)
    while h.clock.now < 36 / AGING_TOKENS_PER_S + 0.05:  # its 36 extra tokens are aged away
        h.step()
    short = h.submit(prompt=4, max_tokens=2)
    h.run()
    assert long.token_steps[0] < short.token_steps[0]
    assert_drained(h)
