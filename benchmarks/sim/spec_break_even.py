"""`python -m benchmarks spec-break-even`: where n-gram speculation stops paying, predicted from a fitted step-cost
model (`python -m benchmarks fit-cost`) and an acceptance rate (the arithmetic: `benchmarks.sim.cost.speculation`).
`--check RESULT_DIR ...` sets it beside measured runs and the simulator's (`benchmarks.sim.spec_check`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.sim.cost.files import load_fitted, verify_steps_note
from benchmarks.sim.cost.speculation import crossing, speedups
from benchmarks.sim.spec_check import check


def _verify_note(path: Path) -> str | None:
    try:
        return verify_steps_note(path)
    except (OSError, ValueError):
        return None  # the cost model's own loading reports a bad file


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks spec-break-even", description=__doc__)
    parser.add_argument("--cost-model", type=Path, required=True, help="cost.json written by fit-cost")
    parser.add_argument(
        "--acceptance-rate",
        type=float,
        default=None,
        help="R: each draft right with this chance (needed without --check)",
    )
    parser.add_argument(
        "--draft-rate",
        type=float,
        default=None,
        help="D: a row has drafts at a step with this chance (default 1, or with --check the runs' counters)",
    )
    parser.add_argument("--k", type=int, default=4, help="drafts per row (num_speculative_tokens)")
    parser.add_argument("--context", type=int, default=512, help="tokens cached per row")
    parser.add_argument("--batches", default="1,2,3,4,6,8,12,16,24,32", help="comma-separated batch sizes")
    parser.add_argument(
        "--check",
        type=Path,
        nargs="+",
        default=None,
        help="`ab --speculation both` result folders at several --seats / --max-concurrency: measured break-even "
        "beside simulated (their acceptance rate from the runs' counters unless --acceptance-rate is given)",
    )
    args = parser.parse_args(argv)
    if args.acceptance_rate is not None and not 0.0 <= args.acceptance_rate < 1.0:
        parser.error("--acceptance-rate must be in [0, 1)")
    if args.draft_rate is not None and not 0.0 <= args.draft_rate <= 1.0:
        parser.error("--draft-rate must be in [0, 1]")
    if (note := _verify_note(args.cost_model)) is not None:
        print(note, file=sys.stderr)
    if args.check is not None:
        try:
            print(check(args.cost_model, args.check, args.acceptance_rate, args.draft_rate))
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        return
    if args.acceptance_rate is None:
        parser.error("--acceptance-rate is required without --check")
    if args.k < 1 or args.context < 0:
        parser.error("--k must be >= 1 and --context >= 0")
    try:
        batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        parser.error("--batches must be comma-separated integers")
    if not batches or batches[0] < 1:
        parser.error("--batches must be positive")
    model = load_fitted(args.cost_model)
    draft_rate = 1.0 if args.draft_rate is None else args.draft_rate
    ratios = speedups(model, args.acceptance_rate, args.k, args.context, batches, draft_rate)
    rows = [{"batch": b, "speedup": round(float(r), 3)} for b, r in zip(batches, ratios, strict=True)]
    losing = [b for b, r in zip(batches, ratios, strict=True) if r <= 1.0]
    between = crossing(batches, ratios.tolist())
    result = {
        "break_even_batch": losing[0] if losing else None,
        "break_even_interpolated": None if between is None else round(between, 2),
        "by_batch": rows,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
