"""The draft-length rule (scheduler/draft_length.py): measured decode-step costs by rows and tokens, read between
and beyond the counts seen; long drafts where a step's cost hardly grows with its tokens, none where every token
costs its share, each row's length by its own acceptance (a first-draft rate and a rate for later drafts given a
right one, counted from judged drafts only), longer drafts where right drafts come in runs, a plain then a full step
at a row count not yet measured, and a probe that lets a row left at 0 or 1 show it has changed."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec.config import SpeculativeConfig
from scheduler.draft_length import (
    PROBE_EVERY,
    Acceptance,
    DraftLengthRule,
    PooledAcceptance,
    StepCosts,
    acceptance_rates,
)


def rule_with(rows: int, cost: dict[int, float]) -> DraftLengthRule:
    """A rule that has measured decode steps of `rows` rows at each token count in `cost`."""
    rule = DraftLengthRule()
    for tokens, seconds in cost.items():
        rule.observe(rows, tokens, seconds)
    return rule


def independent(rule: DraftLengthRule, rates: np.ndarray, caps: np.ndarray, rows: int) -> np.ndarray:
    """The rule's choice with one rate for every draft, first and later alike (independent acceptance), in a
    decode step of `rows` rows."""
    return rule.choose(rates, rates, caps, rows, rows, rows)


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
    assert independent(rule, np.full(32, 0.5), np.full(32, 4), 32).sum() == 0  # a plain step, to measure
    rule.observe(32, 32, 0.032)
    assert independent(rule, np.full(32, 0.5), np.full(32, 4), 32).sum() == 0  # measured: drafts do not pay


def test_a_verify_step_counts_only_the_drafts_it_judged() -> None:
    """Of k drafts with m accepted: the first is judged (right if m >= 1); draft j > 1 is judged only after j - 1
    right ones, so min(m, k - 1) later drafts are judged and m - 1 of them right; a rejection ends the judging."""
    cases = {  # (drafts, accepted) -> (first judged, first right, later judged, later right)
        (4, 0): (1, 0, 0, 0),  # the first is wrong: the other three never judged
        (4, 1): (1, 1, 1, 0),  # the second judged and wrong
        (4, 2): (1, 1, 2, 1),
        (4, 4): (1, 1, 3, 3),  # all right: every draft judged
        (1, 1): (1, 1, 0, 0),
        (1, 0): (1, 0, 0, 0),
        (0, 0): (0, 0, 0, 0),  # no drafts: nothing judged
    }
    for (drafts, accepted), want in cases.items():
        counts = Acceptance()
        counts.record(drafts, accepted)
        assert (counts.first_judged, counts.first_right, counts.later_judged, counts.later_right) == want
    summed = Acceptance()
    for drafts, accepted in cases:
        summed.record(drafts, accepted)
    assert (summed.first_judged, summed.first_right, summed.later_judged, summed.later_right) == (6, 4, 6, 4)


def test_acceptance_rates_start_at_one_half_and_a_later_rate_without_history_is_the_first() -> None:
    """a: one right and one wrong first draft assumed; c: two later drafts assumed, right at rate a, so a sequence
    whose later drafts were never judged is valued as the independent model values it, not at 1/2."""
    fresh, copying, missing, held = Acceptance(), Acceptance(), Acceptance(), Acceptance()
    for _ in range(10):
        copying.record(4, 4)  # 10 firsts right, 30 later drafts right
        missing.record(4, 0)  # 10 firsts wrong, no later one judged
        held.record(1, 1)  # held at one draft: 10 firsts right, no later one judged
    first, later = acceptance_rates([fresh, copying, missing, held])
    assert first.tolist() == pytest.approx([0.5, 11 / 12, 1 / 12, 11 / 12])
    assert later.tolist() == pytest.approx([0.5, (30 + 22 / 12) / 32, 1 / 12, 11 / 12])
    # 4 drafts a step, the first 2 right and the third wrong, 10 steps: the firsts all right, and of the 20 later
    # drafts judged, 10 right (the 10 drafts after each rejection were never judged, so they do not count as wrong)
    thirds = Acceptance()
    for _ in range(10):
        thirds.record(4, 2)
    first, later = acceptance_rates([thirds])
    assert (first[0], later[0]) == pytest.approx((11 / 12, (10 + 22 / 12) / 22))
    assert [r.shape for r in acceptance_rates([])] == [(0,), (0,)]


def test_a_new_sequence_starts_from_the_servers_pooled_acceptance() -> None:
    """A fresh server's prior is 1/2 (and no later rate: c follows a); after verify steps whose drafts were mostly
    right, a sequence with no history of its own starts at the pooled rates, and its own drafts weigh as before."""
    pooled = PooledAcceptance()
    assert pooled.prior() == (0.5, None)
    for _ in range(100):
        pooled.record(4, 4)
    a0, c0 = pooled.prior()
    assert a0 > 0.95 and c0 is not None and c0 > 0.98
    fresh, missing = Acceptance(), Acceptance()
    for _ in range(10):
        missing.record(4, 0)
    first, later = acceptance_rates([fresh, missing], (a0, c0))
    assert (first[0], later[0]) == pytest.approx((a0, c0))
    assert first[1] == pytest.approx(2 * a0 / 12) and later[1] == pytest.approx(c0)
    pooled.record(0, 0)  # a step without drafts judges nothing
    assert pooled.prior() == (a0, c0)


def test_the_pooled_prior_forgets_and_gives_a_new_sequence_its_drafts_at_once() -> None:
    """Where a draft costs 25 % of a plain step, a first-step sequence on a fresh server (a = c = 1/2) verifies
    fewer than all 4 drafts; after other sequences' drafts were right it verifies all 4 at its first step; after a
    long run of wrong drafts the prior has moved down again (a decaying count, not the whole history)."""
    rule = rule_with(1, {t: 0.010 * (1 + 0.25 * (t - 1)) for t in range(1, 6)})
    first, later = acceptance_rates([Acceptance()], rule.pooled.prior())
    assert rule.choose(first, later, np.array([4]), 1, 1, 1).tolist()[0] < 4
    for _ in range(50):
        rule.pooled.record(4, 4)
    first, later = acceptance_rates([Acceptance()], rule.pooled.prior())
    assert rule.choose(first, later, np.array([4]), 1, 1, 1).tolist() == [4]
    for _ in range(1000):
        rule.pooled.record(4, 0)
    assert rule.pooled.prior()[0] < 0.05


def test_drafts_that_come_in_runs_get_longer_drafts_than_independent_acceptance_gives() -> None:
    """Copy-like text: a step's first draft is right half the time, a later one 95% of the time after a right one.
    Taken as independent at the overall rate a (accepted over judged), the j-th draft is worth a**j, which falls
    fast; given the runs it is worth about 0.5 * 0.95**(j-1), so where a draft costs 30% of a plain step the
    conditional rule verifies all 4 and the independent one fewer, from the same history."""
    rng = np.random.default_rng(7)
    counts, accepted, rejections = Acceptance(), 0, 0
    for _ in range(400):
        right = 0
        if rng.random() < 0.5:
            right = 1
            while right < 4 and rng.random() < 0.95:
                right += 1
        counts.record(4, right)
        accepted, rejections = accepted + right, rejections + (right < 4)
    overall = (accepted + 1) / (accepted + rejections + 2)  # the one rate over judged drafts
    first, later = acceptance_rates([counts])
    assert 0.7 < overall < 0.8 and 0.4 < first[0] < 0.6 and later[0] > 0.9
    rule = rule_with(1, {t: 0.010 * (1 + 0.3 * (t - 1)) for t in range(1, 9)})
    assert independent(rule, np.array([overall]), np.array([4]), 1).tolist()[0] < 4
    assert rule.choose(first, later, np.array([4]), 1, 1, 1).tolist() == [4]


def test_a_rows_later_rate_sets_how_far_past_its_first_draft_it_goes() -> None:
    """Same first-draft rate, different later rates: the row whose later drafts hold up drafts further."""
    rule = rule_with(3, {3: 0.010, 6: 0.012, 10: 0.016, 18: 0.030})
    lengths = rule.choose(np.array([0.9, 0.9, 0.9]), np.array([0.95, 0.75, 0.05]), np.array([4, 4, 4]), 3, 3, 3)
    assert lengths[0] == 4 and lengths[0] > lengths[1] > lengths[2] == 1


def test_a_step_whose_cost_hardly_grows_takes_every_draft() -> None:
    rule = rule_with(2, {2: 0.010, 16: 0.011, 64: 0.012})  # weight-bound: tokens are nearly free
    assert independent(rule, np.array([0.8, 0.6]), np.array([4, 4]), 2).tolist() == [4, 4]


def test_a_step_where_every_token_costs_its_share_takes_none() -> None:
    rule = rule_with(32, {32: 0.032, 160: 0.160})  # compute-bound: a draft costs a whole token's time
    assert independent(rule, np.full(32, 0.7), np.full(32, 4), 32).tolist() == [0] * 32


def test_a_verify_step_dearer_than_its_tokens_suggest_takes_none() -> None:
    # 32 plain rows run fused (20 ms); any step with drafts runs as chunks (60 ms at 64 tokens)
    rule = rule_with(32, {32: 0.020, 64: 0.060, 160: 0.100})
    assert independent(rule, np.full(32, 0.6), np.full(32, 4), 32).sum() == 0


def test_rows_that_accept_more_get_longer_drafts() -> None:
    rule = rule_with(3, {3: 0.010, 6: 0.012, 10: 0.016, 18: 0.030})
    lengths = independent(rule, np.array([0.95, 0.5, 0.05]), np.array([6, 6, 6]), 3)
    assert lengths[0] > lengths[1] >= lengths[2] == 0
    # the chosen total is exactly the best count, even where rows tie
    tied = rule_with(8, {8: 0.010, 16: 0.012, 32: 0.040})
    lengths = independent(tied, np.full(8, 0.5), np.full(8, 3), 8)
    assert 0 < int(lengths.sum()) <= 8 and (lengths <= 1).all()


def test_caps_bound_each_row() -> None:
    rule = rule_with(2, {2: 0.010, 64: 0.0101})
    assert independent(rule, np.array([0.9, 0.9]), np.array([2, 0]), 2).tolist() == [2, 0]


def test_at_a_new_row_count_a_full_step_then_a_plain_one_are_measured() -> None:
    rule = DraftLengthRule()
    assert independent(rule, np.array([0.1]), np.array([4]), 1).tolist() == [4]
    rule.observe(1, 5, 0.050)
    assert independent(rule, np.array([0.1]), np.array([4]), 1).tolist() == [0]
    rule.observe(1, 1, 0.010)
    assert independent(rule, np.array([0.1]), np.array([4]), 1).tolist() == [0]  # measured: it does not pay
    assert independent(rule, np.array([0.9]), np.array([4]), 1).tolist() == [0]  # 5x the time for at most 4.1x


def test_every_probe_step_a_row_left_at_zero_or_one_verifies_one_more() -> None:
    rule = rule_with(2, {2: 0.002, 10: 0.010})
    seen = [independent(rule, np.full(2, 0.3), np.full(2, 4), 2).tolist() for _ in range(PROBE_EVERY)]
    assert seen[:-1] == [[0, 0]] * (PROBE_EVERY - 1) and seen[-1] == [1, 1]
    # a row held at one draft gets a second, so its later rate is measured; one at its cap or past 1 keeps its own
    rule = rule_with(3, {3: 0.010, 6: 0.012, 10: 0.016, 18: 0.030})
    first, later, caps = np.full(3, 0.9), np.array([0.9, 0.05, 0.05]), np.array([4, 4, 1])
    seen = [rule.choose(first, later, caps, 3, 3, 3).tolist() for _ in range(PROBE_EVERY)]
    assert seen[:-1] == [[4, 1, 1]] * (PROBE_EVERY - 1) and seen[-1] == [4, 2, 1]


def test_draft_length_is_checked() -> None:
    assert SpeculativeConfig(num_speculative_tokens=3).draft_length == "auto"
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "draft_length": "fixed"}').draft_length == "fixed"
    with pytest.raises(ValueError, match="draft_length must be one of auto, fixed"):
        SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "draft_length": "sometimes"}')
