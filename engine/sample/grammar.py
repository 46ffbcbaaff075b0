"""What the engine needs of a grammar that constrains a sequence's tokens, and the mask it turns into.

The engine knows no grammar language and no backend: a request carries a `Grammar` (compiled elsewhere, see
api/structured/), and each of its sequences gets a `GrammarMatcher` of its own when it is added. Every step, each
constrained row's matcher fills its row of a packed bitmask (bit i of word j allows token 32*j + i); the sampler
masks that row's logits with it; the sampled token is then fed back to the matcher.

Preemption keeps a sequence's row and the tokens it produced (scheduler/lifecycle.py), and a recomputed sequence
samples only past its known tokens, so the matcher is never ahead of the row and nothing has to be rolled back.
"""

from __future__ import annotations

from typing import Protocol

import torch

BITS_PER_WORD = 32


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the tokens allowed next into row `index` of `bitmask` (int32 [rows, words_for(vocab)])."""

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it (the state is then unchanged)."""

    def is_terminated(self) -> bool:
        """The grammar is complete and accepted its end (a stop token): the sequence is done."""


class Grammar(Protocol):
    """A compiled grammar, shared by every sequence constrained by it."""

    def matcher(self) -> GrammarMatcher: ...


def words_for(vocab_size: int) -> int:
    return -(-vocab_size // BITS_PER_WORD)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] packed bits -> bool [rows, vocab_size], True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31's sign copies are masked off by & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def fill_bitmasks(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """The allowed-token masks of `matchers`, bool [len(matchers), vocab_size].

    One call per matcher: each is a state machine of its own (xgrammar's is C++, a few microseconds a call), which
    no tensor operation can stand in for. The unpacking is one tensor operation for all of them."""
    bitmask = torch.zeros(len(matchers), words_for(vocab_size), dtype=torch.int32)
    for index, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask, index)
    return unpack_bitmask(bitmask, vocab_size)
