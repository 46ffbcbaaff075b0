"""How many drafts each row verifies this step: chosen from the live batch, each sequence's measured acceptance and
this engine's measured step cost, so that the step yields the most tokens per second.

A row that verifies j drafts emits its first draft's worth only if the draft is right: with acceptance rate a
(each draft right with probability a, as vLLM's synthetic acceptance models it), its j-th draft adds a**j expected
tokens and one token to the step. The step's yield is (tokens it emits) / (its time); adding the draft increments in
order of a**j, the yield after m of them is (E0 + the m best gains) / cost(n0 + m), and the rule takes the m that
maximises it (0: no drafts, where verifying costs more than it saves). Since a**j falls with j, the m best are a
prefix of each row's drafts, so every row gets its own length. With a step cost that grows slowly in tokens (small
batches on a CPU that is bound by reading the weights), long drafts pay; where it grows with every token (a big
batch), none do. docs/speculative.md compares this with a fixed k and vLLM's table by batch size.

The cost is measured, not assumed: every step's (rows, tokens, seconds) feeds a running mean per (rows, tokens),
read at the step's row count by linear interpolation between the token counts seen and a least-squares line beyond
them. At a row count not yet measured, the first step verifies every draft and the next runs plain; and
every PROBE_EVERY steps a row the rule left without drafts verifies one, so a sequence whose acceptance was low can
show it has changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PROBE_EVERY = 32  # steps between probes: rows at 0 drafts verify one
COST_MEMORY = 0.1  # weight of a new measurement in a token count's running mean


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
        slope, intercept = np.polyfit(counts, times, 1)
        above = np.maximum(intercept + max(slope, 0.0) * tokens, times[-1])
        return np.where(tokens > counts[-1], above, np.interp(tokens, counts, times))


def acceptance_rates(accepted: Sequence[int], rejections: Sequence[int]) -> np.ndarray:
    """Each sequence's chance that a draft is right: its accepted drafts over the drafts actually judged (the
    accepted ones and one per rejection; the drafts after a rejection were never judged, and counting them as wrong
    would read a rate a as (a + ... + a**k) / k), with one right and one wrong assumed (so a sequence without
    history starts at 1/2, and no rate is ever exactly 0 or 1)."""
    accepted_drafts = np.asarray(accepted, dtype=np.float64)
    return (accepted_drafts + 1.0) / (accepted_drafts + np.asarray(rejections, dtype=np.float64) + 2.0)


@dataclass
class DraftLengthRule:
    """Per-step draft lengths from the measured step cost (`observe` each step) and the rows' acceptance."""

    costs: StepCosts = field(default_factory=StepCosts)
    steps: int = 0

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A step that ran: `rows` rows, `tokens` tokens in all (drafts and prompt chunks included). Steps with a
        prompt chunk count too: under a steady stream of arrivals most steps carry one, and a rule that waited for
        decode-only steps at a row count would keep exploring there (every draft, every step)."""
        self.costs.observe(rows, tokens, seconds)

    def choose(self, rates: np.ndarray, caps: np.ndarray, rows: int, step_tokens: int, step_yield: int) -> np.ndarray:
        """Drafts per drafting row (acceptance `rates`, at most `caps` drafts each), in a step of `rows` rows and
        `step_tokens` tokens without drafts that emits `step_yield` tokens without them."""
        self.steps += 1
        if len(caps) == 0:
            return caps.copy()
        if not self.costs.verify_known(rows):
            return caps.copy()  # first time at this many rows: a step with every draft, to measure
        if not self.costs.plain_known(rows):
            return np.zeros_like(caps)  # then a plain one
        width = int(caps.max(initial=0))
        depth = np.arange(1, width + 1)
        gains = rates[:, None] ** depth[None, :]  # [rows, width]: the j-th draft's expected tokens
        gains[depth[None, :] > caps[:, None]] = -1.0  # past a row's cap: never taken
        # Best gains first; a row's own gains fall with j, so any top-m set holds a prefix of each row's drafts.
        ranked = np.argsort(-gains.ravel(), kind="stable")
        ranked = ranked[gains.ravel()[ranked] >= 0]
        totals = step_yield + np.concatenate(([0.0], np.cumsum(gains.ravel()[ranked])))
        yields = totals / self.costs.cost(rows, step_tokens + np.arange(len(ranked) + 1, dtype=np.float64))
        best = int(np.argmax(yields))
        lengths = np.bincount(ranked[:best] // width, minlength=len(caps)).astype(caps.dtype)
        if self.steps % PROBE_EVERY == 0:
            lengths = np.where((lengths == 0) & (caps > 0), 1, lengths)
        return lengths
