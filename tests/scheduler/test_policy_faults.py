"""A plug-in policy that raises, or breaks the contract, in any callback: no innocent request pays for it.

Each faulty policy is its mode's built-in one but for one callback (tests/scheduler/faulty_policies.py). The same
requests, submitted at the same steps, get the same answers (outcome and tokens) as under the built-in policy
alone: when the policy raises and no request is to blame, the built-in one takes over (said once in the log, counted
in `guard.fallbacks`). Only a request the engine refuses while the policy admits it fails, and only that one.

Before: `plan` raising failed the requests at the head of the queue, then raised out of the step; `plan` or
`on_finished` raising while requests ran left the loop asleep with no wake-up; `next_deadline` raising killed the
loop thread."""

from __future__ import annotations

import logging

import pytest

from scheduler.config import Mode
from scheduler.policy import Policy
from scheduler.request import Outcome, RequestStatus
from tests.fakes import Harness, assert_drained, build
from tests.scheduler.faulty_policies import CALLBACKS, CONTRACT_BREAKERS, MODULE, PolicyBug, raising

Answers = dict[str, tuple[Outcome | None, list[int]]]
TAKES_OVER = "takes over from now on"
# (callback, fail_from): from the first call, and from the third (requests are running and waiting by then)
CASES = [(c, 1) for c in CALLBACKS] + [(c, 3) for c in ("plan", "on_finished", "next_deadline")]


def harness(mode: Mode, policy: str | None) -> Harness:
    # A step lasts 1 s on the fake clock: a partial dynamic batch leaves after 2 steps' worth, a static one at
    # 3 s ticks, so requests wait, run and (dynamic, static) are held.
    return build(mode, seats=2, policy=policy, batch_timeout_ms=2000.0, batch_window_ms=3000.0)


def workload(h: Harness, drain: bool = False) -> Answers:
    """Seven requests on 2 seats, in three waves; the loop's calls to `next_deadline` when idle, made here too."""
    h.submit(prompt=5, max_tokens=4, request_id="a")
    h.submit(prompt=3, max_tokens=2, request_id="b")
    h.scheduler.next_deadline()
    h.step()
    h.submit(prompt=7, max_tokens=3, request_id="c")
    h.submit(prompt=2, max_tokens=5, request_id="d")
    h.submit(prompt=4, max_tokens=1, request_id="e")
    h.scheduler.next_deadline()
    h.step()
    h.step()
    h.submit(prompt=6, max_tokens=2, request_id="f")
    h.submit(prompt=1, max_tokens=3, request_id="g")
    h.scheduler.next_deadline()
    if drain:
        h.scheduler.begin_drain()  # ends the never-started ones with SHUTDOWN, in both runs alike
    h.run()
    assert all(s.done for s in h.streams.values()), h.describe()
    return {rid: (s.reason, s.tokens) for rid, s in h.streams.items()}


def fallback_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if TAKES_OVER in r.getMessage()]


def test_the_cases_cover_every_callback_of_the_policy_class() -> None:
    hooks = {name for name, value in vars(Policy).items() if callable(value) and not name.startswith("_")}
    assert hooks | {"__init__"} == set(CALLBACKS)


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
@pytest.mark.parametrize(("callback", "fail_from"), CASES, ids=[f"{c}-from-{n}" for c, n in CASES])
def test_a_raising_callback_leaves_every_answer_as_without_it(
    mode: Mode, callback: str, fail_from: int, caplog: pytest.LogCaptureFixture
) -> None:
    drain = callback == "begin_drain"
    alone = workload(harness(mode, None), drain)
    assert [rid for rid, (outcome, _) in alone.items() if outcome is not None and outcome.completed]
    with caplog.at_level(logging.ERROR, logger="batchserve.scheduler"):
        h = harness(mode, raising(mode, callback, fail_from))
        assert workload(h, drain) == alone
    assert h.scheduler.guard.fallbacks == 1
    assert type(h.scheduler.policy).__module__ != MODULE  # the built-in one runs now
    lines = fallback_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]  # once, whatever the policy would have raised later
    assert callback in lines[0].getMessage() and "PolicyBug" in lines[0].getMessage()
    assert_drained(h)


@pytest.mark.parametrize("name", CONTRACT_BREAKERS)
def test_a_policy_that_breaks_the_contract_is_replaced_before_it_harms_anyone(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    alone = workload(harness(Mode.CONTINUOUS, None))
    with caplog.at_level(logging.ERROR, logger="batchserve.scheduler"):
        h = harness(Mode.CONTINUOUS, f"{MODULE}:{name}")
        assert workload(h) == alone
    assert h.scheduler.guard.fallbacks == 1 and len(fallback_lines(caplog)) == 1
    assert h.runner.violations == []
    assert_drained(h)


@pytest.mark.parametrize("policy", [None, "scheduler.examples.shortest_prompt_first:ShortestPromptFirst"])
def test_a_request_the_engine_refuses_while_admitting_fails_alone(policy: str | None) -> None:
    alone = workload(harness(Mode.CONTINUOUS, policy))
    h = harness(Mode.CONTINUOUS, policy)
    real_add = h.engine.add

    def add(seq_id: int, prompt: object, *args: object) -> None:
        poison = h.streams.get("g")
        if poison is not None and poison.request is not None and seq_id == poison.request.seq_id:
            raise ValueError("a value the checks missed")
        real_add(seq_id, prompt, *args)  # type: ignore[arg-type]

    h.engine.add = add  # type: ignore[method-assign,assignment]
    answers = workload(h)
    # g (the shortest prompt: the plug-in admits it first, ahead of older requests) fails; everyone else is served
    g = h.streams["g"]
    assert g.reason is Outcome.FAILED and g.finish is not None
    assert g.finish.error == "internal error while admitting the request: ValueError"
    assert {rid: a for rid, a in answers.items() if rid != "g"} == {rid: a for rid, a in alone.items() if rid != "g"}
    assert h.scheduler.guard.fallbacks == 0  # the request's fault, not the policy's
    assert_drained(h)


def test_a_policy_that_swallows_the_refusal_does_not_keep_the_request() -> None:
    h = build(Mode.CONTINUOUS, seats=2, policy=f"{MODULE}:SwallowsRefusals")
    h.engine.add = _refuse  # type: ignore[method-assign,assignment]
    stream = h.submit(prompt=3, max_tokens=2)
    h.run()
    assert stream.reason is Outcome.FAILED and h.scheduler.guard.fallbacks == 0
    assert stream.request is not None and stream.request.status is RequestStatus.RELEASED


def _refuse(*args: object) -> None:
    raise PolicyBug("refused")
