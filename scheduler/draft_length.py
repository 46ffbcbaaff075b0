"""How many drafts each row verifies this step: chosen from the live batch, each sequence's measured acceptance and
this engine's measured step cost, so that the step yields the most tokens per second.

A row that verifies j drafts emits its j-th draft's worth only if that draft and every one before it are right.
Right drafts come in runs in copy-like text (a quote that matches goes on matching), so a draft is not taken as
right with one rate, independently (vLLM's synthetic acceptance): each sequence has two rates, a for the first
draft of a step and c for a later draft given the one before it was right (`Acceptance`). Its j-th draft then adds
a * c**(j-1) expected tokens and one token to the step. The step's yield is (tokens it emits) / (its time); adding
the draft increments in order of gain, the yield after m of them is (E0 + the m best gains) / cost(n0 + m), and the
rule takes the m that maximises it (0: no drafts, where verifying costs more than it saves). Since c < 1 the gains
fall with j, so the m best are a prefix of each row's drafts, and every row gets its own length. With a step cost
that grows slowly in tokens (small batches on a CPU that is bound by reading the weights), long drafts pay; where it
grows with every token (a big batch), none do. docs/speculative.md compares this with a fixed k and vLLM's table by
batch size.

A new sequence starts from what its predecessors showed, not from nothing: the rule keeps the server's acceptance
over recent judged drafts (`PooledAcceptance`, a decaying count), and each sequence's rates start there with the
weight of two drafts, so on a workload whose drafts are mostly right the first steps of every request already
verify long drafts (with a prior of 1/2 each request spent its first ten steps learning what the last one knew).

The cost is measured, not assumed: every step's (rows, tokens, seconds) feeds a running mean per (rows, tokens),
read at the step's row count by linear interpolation between the token counts seen and a least-squares line beyond
them. At a row count not yet measured, the first step verifies every draft and the next runs plain; and
every PROBE_EVERY steps a row the rule left with fewer than two drafts verifies one more, so a sequence whose
acceptance was low can show it has changed, and one held at a single draft gets its later drafts judged (c is
learnt only from them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass, field

import numpy as np

PROBE_EVERY = 32  # steps between probes: rows at 0 or 1 drafts verify one more
COST_MEMORY = 0.1  # weight of a new measurement in a token count's running mean
POOL_MEMORY = 0.995  # per verify step, the weight the server's pooled acceptance keeps of its past (~200 steps)


@dataclass
class StepCosts:
    """Measured time of steps by their rows and tokens (rows plus drafts plus prompt chunks): a running mean per
    (rows, tokens). Keyed by rows too, because a verify step is not a plain step with more rows: its rows'
    positions share their contexts, and the LM head and acceptance work grow with the drafts."""

    seconds: dict[int, dict[int, float]] = field(default_factory=dict)  # rows -> tokens -> seconds

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        if rows <= 0 or tokens < rows or seconds <= 0:
            return
        table = self.seconds.setdefault(rows, {})
        old = table.get(tokens)
        table[tokens] = seconds if old is None else old + COST_MEMORY * (seconds - old)

    def plain_known(self, rows: int) -> bool:
        return rows in self.seconds.get(rows, {})

    def verify_known(self, rows: int) -> bool:
        return any(tokens > rows for tokens in self.seconds.get(rows, {}))

    def cost(self, rows: int, tokens: np.ndarray) -> np.ndarray:
        """Seconds for a step of `rows` rows and `tokens` tokens: interpolated between the token counts seen at this
        row count, a least-squares line beyond them (never below the largest count's time). Needs two counts."""
        table = self.seconds[rows]
        counts = np.array(sorted(table), dtype=np.float64)
        times = np.array([table[int(c)] for c in counts])
        within = np.interp(tokens, counts, times)
        if tokens.max(initial=0) <= counts[-1]:
            return within  # the line is for beyond them only: a least-squares solve a step, saved
        slope, intercept = np.polyfit(counts, times, 1)
        above = np.maximum(intercept + max(slope, 0.0) * tokens, times[-1])
        return np.where(tokens > counts[-1], above, within)


def judged_drafts(drafts: int, accepted: int) -> tuple[int, int, int, int]:
    """(first judged, first right, later judged, later right) of a verify step of `drafts` drafts whose first
    `accepted` were right. The first draft is always judged; draft j > 1 only if the j - 1 before it were right
    (j <= accepted + 1), so min(accepted, drafts - 1) later drafts were judged, and accepted - 1 of them right. A
    step without drafts judged nothing."""
    if drafts <= 0:
        return 0, 0, 0, 0
    return 1, int(accepted > 0), min(accepted, drafts - 1), max(accepted - 1, 0)


@dataclass
class Acceptance:
    """One sequence's judged drafts, by kind: the first draft of a verify step, and a later draft whose previous one
    was right. Only judged drafts count: a row's judging ends at its first wrong draft, so the drafts after it say
    nothing (counting them as wrong would read a rate a as (a + ... + a**k) / k)."""

    first_judged: int = 0
    first_right: int = 0
    later_judged: int = 0
    later_right: int = 0

    def record(self, drafts: int, accepted: int) -> None:
        """A verify step of `drafts` drafts whose first `accepted` were right (`judged_drafts`)."""
        step = judged_drafts(drafts, accepted)
        self.first_judged, self.first_right, self.later_judged, self.later_right = (
            count + new for count, new in zip(astuple(self), step, strict=True)
        )


@dataclass
class PooledAcceptance:
    """The server's acceptance over recent verify steps, every sequence's judged drafts together, each count decayed
    by POOL_MEMORY a step: where a new sequence's rates start."""

    first_judged: float = 0.0
    first_right: float = 0.0
    later_judged: float = 0.0
    later_right: float = 0.0

    def record(self, drafts: int, accepted: int) -> None:
        """As `Acceptance.record`, for any sequence's verify step; the past decays by POOL_MEMORY a verify step."""
        if drafts <= 0:
            return
        step = judged_drafts(drafts, accepted)
        self.first_judged, self.first_right, self.later_judged, self.later_right = (
            POOL_MEMORY * count + new for count, new in zip(astuple(self), step, strict=True)
        )

    def prior(self) -> tuple[float, float | None]:
        """(a0, c0): the pooled first-draft rate and later rate, each with one right and one wrong draft assumed
        (1/2 with nothing seen); c0 None until a later draft was judged (a sequence then centres c on its own a)."""
        first = (self.first_right + 1.0) / (self.first_judged + 2.0)
        later = (self.later_right + 1.0) / (self.later_judged + 2.0) if self.later_judged > 0 else None
        return first, later


def acceptance_rates(
    counts: Sequence[Acceptance], prior: tuple[float, float | None] = (0.5, None)
) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's (a, c): the chance its first draft of a step is right, and that a later draft is right given
    the one before it was. a is its right first drafts over its judged ones with two drafts assumed right at the
    prior's rate a0 (the server's pooled rate, `PooledAcceptance`; 1/2 on a fresh server), so it is never exactly 0
    or 1; c the same with its two assumed drafts right at the prior's c0, or where the server has judged no later
    draft yet at rate a, so that without later drafts judged (a row held at one draft) c is a, the independent
    model, not a pessimistic 1/2; and c < 1, so c**j falls with j."""
    table = np.array(
        [(n.first_right, n.first_judged, n.later_right, n.later_judged) for n in counts], dtype=np.float64
    ).reshape(-1, 4)
    first_prior, later_prior = prior
    first = (table[:, 0] + 2.0 * first_prior) / (table[:, 1] + 2.0)
    centre = first if later_prior is None else np.full_like(first, later_prior)
    return first, (table[:, 2] + 2.0 * centre) / (table[:, 3] + 2.0)


@dataclass
class DraftLengthRule:
    """Per-step draft lengths from the measured step cost (`observe` each step) and the rows' acceptance."""

    costs: StepCosts = field(default_factory=StepCosts)
    pooled: PooledAcceptance = field(default_factory=PooledAcceptance)
    steps: int = 0

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A step that ran: `rows` rows, `tokens` tokens in all (drafts and prompt chunks included). Steps with a
        prompt chunk count too: under a steady stream of arrivals most steps carry one, and a rule that waited for
        decode-only steps at a row count would keep exploring there (every draft, every step)."""
        self.costs.observe(rows, tokens, seconds)

    def choose(
        self, first: np.ndarray, later: np.ndarray, caps: np.ndarray, rows: int, step_tokens: int, step_yield: int
    ) -> np.ndarray:
        """Drafts per drafting row (acceptance `first` and `later` as `acceptance_rates` gives them, at most `caps`
        drafts each), in a step of `rows` rows and `step_tokens` tokens without drafts that emits `step_yield`
        tokens without them."""
        self.steps += 1
        if len(caps) == 0:
            return caps.copy()
        if not self.costs.verify_known(rows):
            return caps.copy()  # first time at this many rows: a step with every draft, to measure
        if not self.costs.plain_known(rows):
            return np.zeros_like(caps)  # then a plain one
        width = int(caps.max(initial=0))
        depth = np.arange(1, width + 1)
        gains = first[:, None] * later[:, None] ** (depth[None, :] - 1)  # [rows, width]: the j-th draft's tokens
        gains[depth[None, :] > caps[:, None]] = -1.0  # past a row's cap: never taken
        # Best gains first; a row's own gains fall with j, so any top-m set holds a prefix of each row's drafts.
        ranked = np.argsort(-gains.ravel(), kind="stable")
        ranked = ranked[gains.ravel()[ranked] >= 0]
        totals = step_yield + np.concatenate(([0.0], np.cumsum(gains.ravel()[ranked])))
        yields = totals / self.costs.cost(rows, step_tokens + np.arange(len(ranked) + 1, dtype=np.float64))
        best = int(np.argmax(yields))
        lengths = np.bincount(ranked[:best] // width, minlength=len(caps)).astype(caps.dtype)
        if self.steps % PROBE_EVERY == 0:
            lengths = np.where((lengths < 2) & (lengths < caps), lengths + 1, lengths)
        return lengths
