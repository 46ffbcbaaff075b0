"""Speculative decoding: the acceptance of drafts (the configuration is engine/speculative_config.py).

A row with k drafts computed its last k + 1 positions in the step's forward (engine/forward_batch.py). Acceptance
samples those positions one after another through the plain step's `sample_and_record`, so every emitted token is
the one the engine would have produced without speculation (penalties, min_tokens, grammars, logprobs and every
finish check see the same state); a row goes on while its token equals the next draft and it has not finished.
docs/speculative.md has the whole design.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.grammar import GrammarMatcher
from engine.outputs import TokenOutput
from engine.rows import SequenceRows
from engine.sampling_step import sample_and_record


@dataclass(frozen=True)
class Verified:
    """A step's sampled tokens, each row's in order, and per sampling row how many it emitted and accepted."""

    tokens: tuple[TokenOutput, ...]
    emitted: torch.Tensor  # [sampling rows] tokens emitted (1 .. drafts + 1)
    accepted: list[int]  # per sampling row, drafts that matched the emitted token at their position


def verify_and_record(
    state: SequenceRows,
    rows: torch.Tensor,
    logits: torch.Tensor,
    seq_ids: list[int],
    drafts: Sequence[Sequence[int]],
    eos_token_ids: torch.Tensor,
    matchers: Mapping[int, GrammarMatcher] | None = None,
) -> Verified:
    """Accept the drafts of the sampling `rows` (`drafts[j]` for row j, possibly empty) from `logits`, which holds
    each row's 1 + len(drafts[j]) positions in order; records the emitted tokens as `sample_and_record` does."""
    widths = [len(d) + 1 for d in drafts]
    first = [0, *accumulate(widths)][:-1]  # each row's first position in `logits`
    emitted: list[list[TokenOutput]] = [[] for _ in seq_ids]
    accepted = [0] * len(seq_ids)
    alive = list(range(len(seq_ids)))
    position = 0
    while alive:
        index = torch.tensor([first[j] + position for j in alive], dtype=torch.long)
        outs = sample_and_record(
            state, rows[alive], logits[index], [seq_ids[j] for j in alive], eos_token_ids, matchers
        )
        going = []
        for j, out in zip(alive, outs, strict=True):
            emitted[j].append(out)
            if position < len(drafts[j]) and out.token_id == drafts[j][position]:
                accepted[j] += 1
                if out.finish_reason is None:
                    going.append(j)
        alive, position = going, position + 1
    tokens = tuple(out for row in emitted for out in row)
    return Verified(tokens, torch.tensor([len(row) for row in emitted], dtype=torch.long), accepted)
