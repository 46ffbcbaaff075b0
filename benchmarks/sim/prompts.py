"""Synthetic token ids for simulated prompts and answers, so that requests sharing a prefix in a workload share it
in the simulator's prefix cache too.

A trace line says which of its tokens are shared (`benchmarks.loadgen.trace.TraceRequest`): `prefix_id` and
`prefix_tokens` (its first tokens are those of the named prefix), or `follows` (its prompt is an earlier line's
prompt, then that request's answer, then its own tokens: a conversation's next turn). Every other token is the
line's own. Ids are ranges in disjoint spans: one span per named prefix and one per line, so two prompts share
exactly the tokens their lines say they share. An answer's ids are a function of its prompt (`answer_base`), as a
greedy model's answer is, so the next turn's prompt holds the very ids the simulated engine registered.
"""

from __future__ import annotations

from collections.abc import Sequence

SPAN = 1 << 32  # ids one segment may use: more than any context window
_ANSWER_SPANS = 1 << 40


def answer_base(prompt: Sequence[int]) -> int:
    """The id of the first token generated after `prompt` (the next ones follow it); negative, so that it never
    meets a prompt's ids."""
    return -(hash(tuple(prompt)) % _ANSWER_SPANS + 1) * SPAN


def answer_ids(prompt: Sequence[int], count: int) -> range:
    base = answer_base(prompt)
    return range(base, base + count)


class PromptIds:
    """Each trace line's prompt ids, built when the line is sent (a follower's needs its leader's answer)."""

    def __init__(self) -> None:
        self._spans: dict[str, int] = {}  # prefix id -> its span's number

    def _span(self, key: str) -> int:
        return self._spans.setdefault(key, len(self._spans) + 1) * SPAN

    def own(self, line: int, count: int) -> range:
        """`count` ids only this line has."""
        base = self._span(f"line {line}")
        return range(base, base + count)

    def prompt(self, line: int, prompt_tokens: int, prefix_id: str | None, prefix_tokens: int) -> Sequence[int]:
        """A line that follows no other: the named prefix's first `prefix_tokens` ids, then its own."""
        if prefix_id is None or prefix_tokens == 0:
            return self.own(line, prompt_tokens)
        base = self._span(f"prefix {prefix_id}")
        return [*range(base, base + prefix_tokens), *self.own(line, prompt_tokens - prefix_tokens)]

    def follower(self, line: int, prompt_tokens: int, leader: Sequence[int], answered: int) -> list[int]:
        """A conversation's next turn: the leader's prompt and the `answered` tokens it generated, then its own
        tokens up to `prompt_tokens` (at least one: a turn adds a message)."""
        history = [*leader, *answer_ids(leader, answered)]
        return [*history, *self.own(line, max(1, prompt_tokens - len(history)))]
