"""Speculative acceptance of sampled rows (engine/spec/verify.py) keeps the distribution and the seeds.

The statistical test draws many seeded rows, each verifying two drafts (each position's most likely token, so an
acceptance that compared greedily or accepted everything would accept them always), and checks by chi-square that
the emitted first token follows the row's sampling distribution p0 and, after an accepted first draft, the next one
p1. It also checks that the same statistic rejects what "always accept" would have emitted. The vectorised
acceptance (one row) and the position-by-position loop (many rows) must agree with each other exactly, and a seeded
row emits what plain steps would.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.rows import SequenceRows
from engine.sample.sampling_params import SamplingParams
from engine.sample.sampling_step import sample_and_record
from engine.spec.verify import Verified, accept_at_once, accept_in_order, verify_and_record

VOCAB = 6
PROMPT = [1, 2, 3]
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, -3.0],  # position 0: p0
        [0.0, 0.3, 1.5, -0.5, 0.2, 0.1],  # position 1 (after draft 0): p1
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # the bonus position
    ]
)
TEMPERATURE, TOP_K = 0.9, 5
DRAFTS = [int(LOGITS[0].argmax()), int(LOGITS[1].argmax())]
EOS = torch.tensor([VOCAB + 1])  # never sampled: no row finishes early
# The chi-square critical value at p = 1e-6 (a correct sampler fails one run in a million).
CRITICAL = {4: 33.4, 5: 35.9}


def critical(dof: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        return CRITICAL[dof]
    return float(chi2.ppf(1 - 1e-6, dof))


def expected(logits: torch.Tensor) -> torch.Tensor:
    """The row's sampling distribution: temperature, then the top TOP_K tokens renormalised."""
    probs = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
    probs[probs.argsort()[: VOCAB - TOP_K]] = 0.0
    return probs / probs.sum()


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """The statistic over the tokens p allows, and its degrees of freedom."""
    observed = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB).double()
    support = probs > 0
    assert float(observed[~support].sum()) == 0.0, "a token the filters remove was emitted"
    wanted = probs[support] * len(tokens)
    return float(((observed[support] - wanted) ** 2 / wanted).sum()), int(support.sum()) - 1


def placed(n: int, seed0: int = 0, **params: object) -> SequenceRows:
    state = SequenceRows(EngineConfig(max_rows=n, kv_cache_tokens=16 * n, block_size=4), 16, VOCAB)
    base = {"temperature": TEMPERATURE, "top_k": TOP_K, "max_tokens": 8, **params}
    for i in range(n):
        state.place(i, PROMPT, SamplingParams(seed=seed0 + i, **base))  # type: ignore[arg-type]
        state.token_buffer[i, len(PROMPT) : len(PROMPT) + 2] = torch.tensor(DRAFTS)  # as Engine._place_drafts does
    return state


def emitted_by_row(verified: Verified) -> list[list[int]]:
    rows: dict[int, list[int]] = {}
    for out in verified.tokens:
        rows.setdefault(out.seq_id, []).append(out.token_id)
    return [rows[i] for i in sorted(rows)]


def verify_many(n: int, one_at_a_time: bool) -> list[list[int]]:
    state = placed(n)
    if not one_at_a_time:
        rows = torch.arange(n)
        return emitted_by_row(
            verify_and_record(state, rows, LOGITS.repeat(n, 1), list(range(n)), [DRAFTS] * n, EOS, kernels=None)
        )
    return [
        [
            out.token_id
            for out in verify_and_record(state, torch.tensor([i]), LOGITS, [i], [DRAFTS], EOS, kernels=None).tokens
        ]
        for i in range(n)
    ]


@pytest.mark.parametrize(("n", "one_at_a_time"), [(6000, False), (1500, True)])
def test_emitted_tokens_follow_the_sampling_distribution(n: int, one_at_a_time: bool) -> None:
    emitted = verify_many(n, one_at_a_time)
    assert all(1 <= len(e) <= 3 for e in emitted)
    p0, p1 = expected(LOGITS[0]), expected(LOGITS[1])
    first = [e[0] for e in emitted]
    stat, dof = chi_square(first, p0)
    assert stat < critical(dof), (stat, dof)
    after_accept = [e[1] for e in emitted if e[0] == DRAFTS[0]]
    assert abs(len(after_accept) / n - float(p0[DRAFTS[0]])) < 0.05  # draft 0 accepted with probability p0(x)
    stat, dof = chi_square(after_accept, p1)
    assert stat < critical(dof), (stat, dof)
    # The statistic has the power to see a wrong acceptance: "always accept" (or a greedy comparison, which accepts
    # these argmax drafts always) would have emitted draft 0 first every time.
    assert chi_square([DRAFTS[0]] * n, p0)[0] > critical(dof)
    # ... and "on rejection, draw again from p with the draft still in it" emits it more often than p0 says.
    rejected = [e[0] for e in emitted if e[0] != DRAFTS[0]]
    assert DRAFTS[0] not in rejected


def test_a_seeded_row_emits_what_plain_steps_emit_and_both_acceptances_agree() -> None:
    n = 64
    params = {"presence_penalty": 0.7, "frequency_penalty": 0.3, "repetition_penalty": 1.3, "min_tokens": 1}
    params |= {"logprobs": 2, "top_p": 0.8, "max_tokens": 2}  # max_tokens 2: a row ends at its second position
    plain = placed(n, 100, **params)
    rows = torch.arange(n)
    expected_tokens: list[list[int]] = [[] for _ in range(n)]
    expected_logprobs: list[list[float | None]] = [[] for _ in range(n)]
    for _ in range(2):
        for out in sample_and_record(plain, rows, LOGITS[:1].repeat(n, 1), list(range(n)), EOS, kernels=None):
            expected_tokens[out.seq_id].append(out.token_id)
            expected_logprobs[out.seq_id].append(out.logprob)
    for accept in (accept_in_order, accept_at_once):
        state = placed(n, 100, **params)
        # Every position has the same logits here, so a plain step's second token is drawn from the same row.
        verified = accept(state, rows, LOGITS[:1].repeat(3 * n, 1), list(range(n)), [DRAFTS] * n, EOS, kernels=None)
        by_row = emitted_by_row(verified)
        for i in range(n):
            assert by_row[i] == expected_tokens[i][: len(by_row[i])]
            # A row goes on exactly while it matched its draft; at max_tokens (2) it stops.
            assert len(by_row[i]) == (2 if by_row[i][0] == DRAFTS[0] else 1)
        assert state.seq_len.tolist() == [len(PROMPT) + len(r) for r in by_row]
        assert [o.logprob for o in verified.tokens] == [
            lp for i in range(n) for lp in expected_logprobs[i][: len(by_row[i])]
        ]
        assert verified.accepted == [int(r[0] == DRAFTS[0]) + int(len(r) > 1 and r[1] == DRAFTS[1]) for r in by_row]
        assert [o.finish_reason is not None for o in verified.tokens] == [j == 1 for r in by_row for j in range(len(r))]


def test_both_acceptances_agree_on_greedy_and_sampled_rows_with_one_or_two_drafts() -> None:
    n = 40
    states = []
    for _ in range(2):
        state = placed(n, 7, max_tokens=3, frequency_penalty=0.4)
        state.temperature[::2] = 0.0  # every other row greedy
        states.append(state)
    rows = torch.arange(n)
    drafts = [DRAFTS if i % 3 else DRAFTS[:1] for i in range(n)]  # rows with one draft and with two
    logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB, generator=torch.Generator().manual_seed(3))
    logits[:, DRAFTS[0]] += 2.0  # the first draft is often right
    split = accept_at_once(states[0], rows, logits, list(range(n)), drafts, EOS, kernels=None)
    loop = accept_in_order(states[1], rows, logits, list(range(n)), drafts, EOS, kernels=None)
    assert emitted_by_row(split) == emitted_by_row(loop)
    assert torch.equal(split.emitted, loop.emitted) and split.accepted == loop.accepted
    assert torch.equal(states[0].seq_len, states[1].seq_len)
    assert torch.equal(states[0].token_buffer, states[1].token_buffer)
    assert 0 < sum(split.accepted) < sum(len(d) for d in drafts)  # some accepted, some rejected


def test_no_sampling_rows_verify_nothing() -> None:
    verified = verify_and_record(placed(1), torch.zeros(0, dtype=torch.long), LOGITS[:0], [], [], EOS, kernels=None)
    assert verified.tokens == () and verified.accepted == [] and len(verified.emitted) == 0
