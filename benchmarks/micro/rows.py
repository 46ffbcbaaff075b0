"""One engine row for a measurement that drives `Engine` directly: add the sequence, reserve its cache, and take it
out again if the cache cannot hold it (the server does this in scheduler/lifecycle.py; a benchmark has no scheduler)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.engine import Engine
from engine.sample.sampling_params import SamplingParams


def add_row(
    engine: Engine, seq_id: int, prompt: Sequence[int], params: SamplingParams, tokens: int, too_small: str
) -> None:
    """Place `seq_id` with `prompt` in a row and reserve cache for `tokens` positions; if the cache cannot hold them,
    the row is removed again and ValueError(`too_small`) raised, so a failed measurement leaves the engine as it found
    it."""
    engine.add(seq_id, prompt, params)
    if not engine.reserve(seq_id, tokens):
        engine.remove(seq_id)
        raise ValueError(too_small)
