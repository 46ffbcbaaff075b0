"""The draft-length rule (scheduler/draft_length.py): measured step costs, read between and beyond the counts seen;
long drafts where a step's cost hardly grows with its tokens, none where every token costs its share, each row's
length by its own acceptance, and a probe that lets a row left at 0 show it has changed."""

from __future__ import annotations

import numpy as np
import pytest

from engine.speculative_config import SpeculativeConfig
from scheduler.draft_length import PROBE_EVERY, DraftLengthRule, StepCosts, acceptance_rates


def rule_with(cost: dict[int, float]) -> DraftLengthRule:
    rule = DraftLengthRule()
    for tokens, seconds in cost.items():
        rule.observe(tokens, seconds)
    return rule


def test_step_costs_interpolate_between_counts_and_extend_a_line_beyond() -> None:
    costs = StepCosts()
    assert not costs.known
    for tokens, seconds in ((1, 0.010), (8, 0.012), (32, 0.036)):
        costs.observe(tokens, seconds)
    assert costs.known
    got = costs.cost(np.array([1.0, 4.5, 20.0, 64.0, 0.5]))
    assert got[0] == pytest.approx(0.010) and got[1] == pytest.approx(0.011) and got[2] == pytest.approx(0.024)
    assert got[3] > 0.036 and 0.005 <= got[4] < 0.010  # beyond: the line; below: at least in proportion
    proportional = StepCosts({8: 0.008, 24: 0.024})
    assert proportional.cost(np.array([4.0]))[0] == pytest.approx(0.004)  # fewer tokens than seen are not free
    costs.observe(1, 0.020)  # a running mean, not the last reading
    assert costs.cost(np.array([1.0]))[0] == pytest.approx(0.011)


def test_acceptance_rates_start_at_one_half() -> None:
    assert acceptance_rates([0, 10, 4], [0, 10, 0]).tolist() == pytest.approx([0.5, 11 / 12, 1 / 6])


def test_a_step_whose_cost_hardly_grows_takes_every_draft() -> None:
    rule = rule_with({1: 0.010, 16: 0.011, 64: 0.012})  # weight-bound: tokens are nearly free
    lengths = rule.choose(np.array([0.8, 0.6]), np.array([4, 4]), step_tokens=2, step_yield=2)
    assert lengths.tolist() == [4, 4]


def test_a_step_where_every_token_costs_its_share_takes_none() -> None:
    rule = rule_with({1: 0.001, 32: 0.032, 160: 0.160})  # compute-bound: a draft costs a whole token's time
    lengths = rule.choose(np.full(32, 0.7), np.full(32, 4), step_tokens=32, step_yield=32)
    assert lengths.tolist() == [0] * 32


def test_rows_that_accept_more_get_longer_drafts() -> None:
    rule = rule_with({1: 0.010, 4: 0.012, 8: 0.016, 16: 0.030})
    lengths = rule.choose(np.array([0.95, 0.5, 0.05]), np.array([6, 6, 6]), step_tokens=3, step_yield=3)
    assert lengths[0] > lengths[1] >= lengths[2] == 0
    # the chosen total is exactly the best count, even where rows tie
    tied = rule.choose(np.full(8, 0.5), np.full(8, 3), step_tokens=8, step_yield=8)
    assert int(tied.sum()) <= 8 and (tied <= 1).all()


def test_caps_bound_each_row() -> None:
    rule = rule_with({1: 0.010, 64: 0.0101})
    assert rule.choose(np.array([0.9, 0.9]), np.array([2, 0]), 2, 2).tolist() == [2, 0]


def test_before_two_counts_are_measured_the_configured_k_is_used() -> None:
    rule = rule_with({1: 0.010})
    assert rule.choose(np.array([0.1]), np.array([4]), 1, 1).tolist() == [4]


def test_every_probe_step_a_row_left_at_zero_verifies_one() -> None:
    rule = rule_with({1: 0.001, 32: 0.032, 160: 0.160})
    seen = [rule.choose(np.full(2, 0.3), np.full(2, 4), 2, 2).tolist() for _ in range(PROBE_EVERY)]
    assert seen[:-1] == [[0, 0]] * (PROBE_EVERY - 1) and seen[-1] == [1, 1]


def test_draft_length_is_checked() -> None:
    assert SpeculativeConfig(num_speculative_tokens=3).draft_length == "auto"
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "draft_length": "fixed"}').draft_length == "fixed"
    with pytest.raises(ValueError, match="draft_length must be one of auto, fixed"):
        SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "draft_length": "sometimes"}')
