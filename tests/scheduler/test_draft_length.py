"""The draft-length rule (scheduler/draft_length.py): measured decode-step costs by rows and tokens, read between
and beyond the counts seen; long drafts where a step's cost hardly grows with its tokens, none where every token
costs its share, each row's length by its own acceptance, a plain then a full step at a row count not yet measured,
and a probe that lets a row left at 0 show it has changed."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec.config import SpeculativeConfig
from scheduler.draft_length import PROBE_EVERY, DraftLengthRule, StepCosts, acceptance_rates


def rule_with(rows: int, cost: dict[int, float]) -> DraftLengthRule:
    """A rule that has measured decode steps of `rows` rows at each token count in `cost`."""
    rule = DraftLengthRule()
    for tokens, seconds in cost.items():
        rule.observe(rows, tokens, seconds)
    return rule


def test_step_costs_interpolate_between_counts_and_extend_a_line_beyond() -> None:
    costs = StepCosts()
    for tokens, seconds in ((1, 0.010), (8, 0.012), (32, 0.036)):
        costs.observe(1, tokens, seconds)
    costs.observe(2, 2, 0.5)  # another row count: its own table
    got = costs.cost(1, np.array([1.0, 4.5, 20.0, 64.0]))
    assert got[:3] == pytest.approx([0.010, 0.011, 0.024]) and got[3] > 0.036
    costs.observe(1, 1, 0.020)  # a running mean, not the last reading
    assert costs.cost(1, np.array([1.0]))[0] == pytest.approx(0.011)


def test_a_row_count_seen_with_prompt_chunks_is_not_explored_at_every_step() -> None:
    """Under steady arrivals most steps carry a prompt chunk: they are costs at their token count, so a row count
    seen only with chunks runs one plain step to measure, then the rule's choice (no drafts where tokens cost their
    share), instead of verifying every draft at every step."""
    rule = DraftLengthRule()
    rule.observe(32, 32 + 256, 0.288)  # compute-bound: a millisecond a token
    assert rule.choose(np.full(32, 0.5), np.full(32, 4), 32, 32, 32).sum() == 0  # a plain step, to measure
    rule.observe(32, 32, 0.032)
    assert rule.choose(np.full(32, 0.5), np.full(32, 4), 32, 32, 32).sum() == 0  # measured: drafts do not pay


def test_acceptance_rates_start_at_one_half_and_count_only_judged_drafts() -> None:
    # (accepted, rejections): none yet; 10 accepted, never rejected; 4 verify steps each rejecting its first draft
    assert acceptance_rates([0, 10, 0], [0, 0, 4]).tolist() == pytest.approx([0.5, 11 / 12, 1 / 6])
    # 4 drafts a step, the first 2 right and the third wrong, 10 steps: 20 of 30 judged drafts right (the 10 drafts
    # after each rejection were never judged); counting them as wrong would read 21/42 = 0.5
    assert acceptance_rates([20], [10]).tolist() == pytest.approx([21 / 32])


def test_a_step_whose_cost_hardly_grows_takes_every_draft() -> None:
    rule = rule_with(2, {2: 0.010, 16: 0.011, 64: 0.012})  # weight-bound: tokens are nearly free
    assert rule.choose(np.array([0.8, 0.6]), np.array([4, 4]), 2, 2, 2).tolist() == [4, 4]


def test_a_step_where_every_token_costs_its_share_takes_none() -> None:
    rule = rule_with(32, {32: 0.032, 160: 0.160})  # compute-bound: a draft costs a whole token's time
    assert rule.choose(np.full(32, 0.7), np.full(32, 4), 32, 32, 32).tolist() == [0] * 32


def test_a_verify_step_dearer_than_its_tokens_suggest_takes_none() -> None:
    # 32 plain rows run fused (20 ms); any step with drafts runs as chunks (60 ms at 64 tokens)
    rule = rule_with(32, {32: 0.020, 64: 0.060, 160: 0.100})
    assert rule.choose(np.full(32, 0.6), np.full(32, 4), 32, 32, 32).sum() == 0


def test_rows_that_accept_more_get_longer_drafts() -> None:
    rule = rule_with(3, {3: 0.010, 6: 0.012, 10: 0.016, 18: 0.030})
    lengths = rule.choose(np.array([0.95, 0.5, 0.05]), np.array([6, 6, 6]), 3, 3, 3)
    assert lengths[0] > lengths[1] >= lengths[2] == 0
    # the chosen total is exactly the best count, even where rows tie
    tied = rule_with(8, {8: 0.010, 16: 0.012, 32: 0.040})
    lengths = tied.choose(np.full(8, 0.5), np.full(8, 3), 8, 8, 8)
    assert 0 < int(lengths.sum()) <= 8 and (lengths <= 1).all()


def test_caps_bound_each_row() -> None:
    rule = rule_with(2, {2: 0.010, 64: 0.0101})
    assert rule.choose(np.array([0.9, 0.9]), np.array([2, 0]), 2, 2, 2).tolist() == [2, 0]


def test_at_a_new_row_count_a_full_step_then_a_plain_one_are_measured() -> None:
    rule = DraftLengthRule()
    assert rule.choose(np.array([0.1]), np.array([4]), 1, 1, 1).tolist() == [4]
    rule.observe(1, 5, 0.050)
    assert rule.choose(np.array([0.1]), np.array([4]), 1, 1, 1).tolist() == [0]
    rule.observe(1, 1, 0.010)
    assert rule.choose(np.array([0.1]), np.array([4]), 1, 1, 1).tolist() == [0]  # measured: it does not pay
    assert rule.choose(np.array([0.9]), np.array([4]), 1, 1, 1).tolist() == [0]  # 5x the time for at most 4.1x


def test_every_probe_step_a_row_left_at_zero_verifies_one() -> None:
    rule = rule_with(2, {2: 0.002, 10: 0.010})
    seen = [rule.choose(np.full(2, 0.3), np.full(2, 4), 2, 2, 2).tolist() for _ in range(PROBE_EVERY)]
    assert seen[:-1] == [[0, 0]] * (PROBE_EVERY - 1) and seen[-1] == [1, 1]


def test_draft_length_is_checked() -> None:
    assert SpeculativeConfig(num_speculative_tokens=3).draft_length == "auto"
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "draft_length": "fixed"}').draft_length == "fixed"
    with pytest.raises(ValueError, match="draft_length must be one of auto, fixed"):
        SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "draft_length": "sometimes"}')
