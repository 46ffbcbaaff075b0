"""Speculative acceptance alone: the per-position loop against the vectorised acceptance (engine/spec/verify.py),
and the engine's choice between them (`verify_and_record`: greedy rows at once, sampled rows in the loop).

Both accept the same drafts from the same logits on the same rows (half greedy, half sampled with top-p), so only
the acceptance's own cost differs: the loop samples each position in its own call (k + 1 calls for the longest
row), the vectorised one samples every position in one call and keeps them with tensor operations. No model: the
logits are random, the drafts are each position's argmax for the first `--right` positions and a random token
after (so greedy rows accept exactly those; sampled rows accept fewer). Each setting's call is timed in turn,
`--repeats` times, medians.

    python -m benchmarks spec-accept --rows 1,8,32 --drafts 4 --right 2 --sampled-share 0.5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from engine.config import EngineConfig
from engine.rows import SequenceRows
from engine.sample.sampling_params import SamplingParams
from engine.spec.verify import accept_at_once, accept_in_order, verify_and_record

VOCAB = 49152  # SmolLM2's
PROMPT = 64


def _setup(
    rows: int, drafts: int, right: int, sampled_share: float
) -> tuple[SequenceRows, torch.Tensor, list[list[int]]]:
    state = SequenceRows(EngineConfig(seats=rows, kv_cache_tokens=rows * 256), 256, VOCAB)
    gen = torch.Generator().manual_seed(0)
    num_sampled = round(rows * sampled_share)
    for seq in range(rows):
        sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=seq, max_tokens=64)
        greedy = SamplingParams(temperature=0.0, max_tokens=64)
        prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist()
        state.seat(seq, prompt, sampled if seq < num_sampled else greedy)
    logits = torch.randn(rows * (drafts + 1), VOCAB, generator=gen) * 4
    best = logits.argmax(-1).view(rows, drafts + 1)
    row_drafts = [
        [int(best[r, i]) if i < right else int(torch.randint(0, VOCAB, (), generator=gen)) for i in range(drafts)]
        for r in range(rows)
    ]
    for r, tokens in enumerate(row_drafts):
        state.token_buffer[r, PROMPT : PROMPT + drafts] = torch.tensor(tokens)
    return state, logits, row_drafts


def _time(call: Callable[[], object], state: SequenceRows, rows: torch.Tensor) -> float:
    """One call's seconds; the rows' lengths and token buffer restored after it, so every call sees the same state."""
    seq_len, buffer = state.seq_len.clone(), state.token_buffer.clone()
    start = time.perf_counter()
    call()
    elapsed = time.perf_counter() - start
    state.seq_len.copy_(seq_len)
    state.token_buffer.copy_(buffer)
    return elapsed


def measure(num_rows: int, drafts: int, right: int, sampled_share: float, repeats: int) -> dict[str, float]:
    state, logits, row_drafts = _setup(num_rows, drafts, right, sampled_share)
    rows = torch.arange(num_rows)
    seq_ids = list(range(num_rows))
    eos = torch.tensor([0])
    settings: dict[str, Callable[[], object]] = {
        "in_order": lambda: accept_in_order(state, rows, logits, seq_ids, row_drafts, eos),
        "vectorised": lambda: accept_at_once(state, rows, logits, seq_ids, row_drafts, eos),
        "engine": lambda: verify_and_record(state, rows, logits, seq_ids, row_drafts, eos),
    }
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(repeats):
        for name, call in settings.items():
            times[name].append(_time(call, state, rows))
    result = {f"{name}_ms": statistics.median(t) * 1000 for name, t in times.items()}
    speedup = result["in_order_ms"] / result["vectorised_ms"]
    return {
        "rows": num_rows,
        "drafts": drafts,
        "right": right,
        "sampled_share": sampled_share,
        **result,
        "speedup": speedup,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks spec-accept",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", default="1,8,32", help="comma-separated row counts")
    parser.add_argument("--drafts", type=int, default=4, help="drafts per row (k)")
    parser.add_argument("--right", type=int, default=2, help="leading drafts that are each position's argmax")
    parser.add_argument("--sampled-share", type=float, default=0.5, help="rows sampled with top-p (the rest greedy)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    for rows in (int(r) for r in args.rows.split(",")):
        print(json.dumps(measure(rows, args.drafts, args.right, args.sampled_share, args.repeats)))


if __name__ == "__main__":
    main()
