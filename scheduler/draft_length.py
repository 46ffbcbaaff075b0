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

The cost is measured, not assumed: every step's (tokens, seconds) feeds a running mean per token count, read by
linear interpolation between counts seen and a least-squares line beyond them. Until two counts are seen the
configured k is used, and every PROBE_EVERY steps a row the rule left without drafts verifies one, so a sequence
whose acceptance was low can show it has changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PROBE_EVERY = 32  # steps between probes: rows at 0 drafts verify one
COST_MEMORY = 0.1  # weight of a new measurement in a token count's running mean


@dataclass
class StepCosts:
    """Measured step time by tokens in the step: a running mean per token count."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else old + COST_MEMORY * (seconds - old)

    @property
    def known(self) -> bool:
        return len(self.seconds) >= 2

    def cost(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds for steps of `tokens` tokens: interpolated between the counts seen, a fitted line beyond them
        (above: never below the largest count's time; below: never below the smallest count's time scaled down in
        proportion, so fewer tokens are never assumed free)."""
        counts = np.array(sorted(self.seconds), dtype=np.float64)
        times = np.array([self.seconds[int(c)] for c in counts])
        slope, intercept = np.polyfit(counts, times, 1)
        line = intercept + max(slope, 0.0) * tokens
        below = np.maximum(line, times[0] * tokens / counts[0])
        above = np.maximum(line, times[-1])
        inside = np.interp(tokens, counts, times)
        return np.where(tokens < counts[0], below, np.where(tokens > counts[-1], above, inside))


def acceptance_rates(drafted: Sequence[int], accepted: Sequence[int]) -> np.ndarray:
    """Each sequence's acceptance rate so far, with one accepted and one rejected draft assumed (so a sequence
    without history starts at 1/2, and no rate is ever exactly 0 or 1)."""
    return (np.asarray(accepted, dtype=np.float64) + 1.0) / (np.asarray(drafted, dtype=np.float64) + 2.0)


@dataclass
class DraftLengthRule:
    """Per-step draft lengths from the measured step cost (`observe` each step) and the rows' acceptance."""

    costs: StepCosts = field(default_factory=StepCosts)
    steps: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        self.costs.observe(tokens, seconds)

    def choose(self, rates: np.ndarray, caps: np.ndarray, step_tokens: int, step_yield: int) -> np.ndarray:
        """Drafts per row (rows with acceptance `rates`, at most `caps` drafts each), for a step of `step_tokens`
        tokens without drafts that emits `step_yield` tokens without them."""
        self.steps += 1
        if not self.costs.known or len(caps) == 0:
            return caps.copy()
        width = int(caps.max(initial=0))
        depth = np.arange(1, width + 1)
        gains = rates[:, None] ** depth[None, :]  # [rows, width]: the j-th draft's expected tokens
        gains[depth[None, :] > caps[:, None]] = -1.0  # past a row's cap: never taken
        # Best gains first; a row's own gains fall with j, so any top-m set holds a prefix of each row's drafts.
        ranked = np.argsort(-gains.ravel(), kind="stable")
        ranked = ranked[gains.ravel()[ranked] >= 0]
        totals = step_yield + np.concatenate(([0.0], np.cumsum(gains.ravel()[ranked])))
        yields = totals / self.costs.cost(step_tokens + np.arange(len(ranked) + 1, dtype=np.float64))
        best = int(np.argmax(yields))
        lengths = np.bincount(ranked[:best] // width, minlength=len(caps)).astype(caps.dtype)
        if self.steps % PROBE_EVERY == 0:
            lengths = np.where((lengths == 0) & (caps > 0), 1, lengths)
        return lengths
