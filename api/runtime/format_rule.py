"""The rule `auto` applies to its measured figures (api/runtime/format_probe.py measures them): which formats are
candidates (their quality measured within the bar), which one wins, its row switch and where one int8 digit takes
over, its margin over the runner-up and whether the noise could reverse it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from api.runtime.format_choice import EVERY_STEP, FormatChoice, format_label, one_digit_label
from api.runtime.format_steps import MEASURED_ROWS, PREFILL_ROWS, Pair
from engine.config import DEFAULT_MAX_QUANTIZED_ROWS

_SCORED_ROWS = (1, 16, PREFILL_ROWS)

# Perplexity against float32 on SmolLM2-135M (`python -m benchmarks quality`, docs/quantization.md).
# Only these are candidates.
MEASURED_QUALITY: Mapping[Pair, float] = {
    ("float32", "none"): 0.0,
    ("bfloat16", "none"): 0.11,
    ("float32", "int4"): 0.21,  # with the int8 LM head (quality/2026-12-05-epyc-zen4-f32-int8-head/)
    ("bfloat16", "int4"): 0.34,
}
QUALITY_BAR_PERCENT = 1.0
# The same with one int8 digit per activation on every int4 projection and the LM head (`--int4-gemm all`; the
# probe times it for the steps past the row switch: quality/2026-12-06-xeon-spr-int4-gemm-rounded-sum/).
ONE_DIGIT_QUALITY: Mapping[Pair, float] = {("float32", "int4"): 0.30, ("bfloat16", "int4"): 0.56}


def one_digit_allowed(pair: Pair) -> bool:
    """Whether `pair`'s steps may run one int8 digit per activation: its measured quality is within the bar."""
    return ONE_DIGIT_QUALITY.get(pair, QUALITY_BAR_PERCENT + 1) <= QUALITY_BAR_PERCENT


def candidates(dtype: str, quantization: str, gguf_int4: bool, stored_float32: bool) -> list[Pair]:
    """The (dtype, quantization) pairs `auto` may pick: measured quality within the bar, int4 only from a GGUF's
    own Q4 blocks (anything else would mean requantising, whose quality is not measured; a Q4_K_M file's Q6_K
    projections are, unmeasured: engine/weights/kquants.py), and bf16 not for a checkpoint stored in float32
    (`stored_float32`: its bf16 quality is not measured at load)."""
    found = []
    for (d, q), cost in MEASURED_QUALITY.items():
        if cost > QUALITY_BAR_PERCENT or (q == "int4" and not gguf_int4) or (d == "bfloat16" and stored_float32):
            continue
        if dtype in ("auto", d) and quantization in ("auto", q):
            found.append((d, q))
    return found


@dataclass(frozen=True)
class _Score:
    reads: dict[int, str]  # at each measured size, whose figure this format serves it in: its own, its dense
    # copy's or its one-digit steps'
    limit: int | None  # the row switch
    worst: float  # its worst ratio to the fastest at the scored sizes
    gemm_from: int | None = None  # steps of this many rows or more run one digit (the runner's min_gemm_rows)


def _large_steps(step_ms: Mapping[str, Mapping[int, float]], dense: str, digit: str) -> dict[int, str]:
    """Which of a quantised format's large-step paths serves each size: one digit (int4_gemm) on the longest run of
    the largest sizes where it is at least as fast as the dense copy (the runner switches to it once, at a row
    count), the dense copy below; whichever of the two was measured where only one was."""
    if digit not in step_ms:
        return {rows: dense for rows in MEASURED_ROWS}
    if dense not in step_ms:
        return {rows: digit for rows in MEASURED_ROWS}
    reads = {rows: dense for rows in MEASURED_ROWS}
    for rows in reversed(MEASURED_ROWS):
        if step_ms[digit][rows] > step_ms[dense][rows]:
            break
        reads[rows] = digit
    return reads


def _gemm_from(reads: Mapping[int, str], limit: int, digit: str) -> int | None:
    """The runner's min_gemm_rows for these reads: the switch + 1 where every size past it reads one digit (then no
    dense copy is needed), else one past the largest size that reads the dense copy; None where none reads one digit."""
    past = [rows for rows in MEASURED_ROWS if rows > limit]
    if not any(reads[rows] == digit for rows in past):
        return None
    dense_sizes = [rows for rows in past if reads[rows] != digit]
    return max(dense_sizes) + 1 if dense_sizes else limit + 1


def _scores(step_ms: Mapping[str, Mapping[int, float]], pairs: Sequence[Pair]) -> dict[Pair, _Score]:
    reads: dict[Pair, tuple[dict[int, str], int | None, int | None]] = {}
    for dtype, quantization in pairs:
        label, dense = format_label(dtype, quantization), format_label(dtype, "none")
        digit = one_digit_label(dtype, quantization)
        if quantization == "none" or (dense not in step_ms and digit not in step_ms):
            limit = None if quantization == "none" else DEFAULT_MAX_QUANTIZED_ROWS  # no dense format to compare
            reads[(dtype, quantization)] = ({rows: label for rows in MEASURED_ROWS}, limit, None)
            continue
        large = _large_steps(step_ms, dense, digit)
        wins = [rows for rows in MEASURED_ROWS if step_ms[label][rows] <= step_ms[large[rows]][rows]]
        limit = max(wins) if wins else 0
        if limit == MEASURED_ROWS[-1]:
            # Winning at the largest size measured: no reason to expect the dense copy to win past it (on a CPU
            # without native bf16 a 512-token dense bf16 prefill is many times the int4 one).
            limit = EVERY_STEP
        by_size = {rows: label if rows <= limit else large[rows] for rows in MEASURED_ROWS}
        reads[(dtype, quantization)] = (by_size, limit, _gemm_from(by_size, limit, digit))
    times = {
        pair: {rows: step_ms[read][rows] for rows, read in by_size.items()} for pair, (by_size, _, _) in reads.items()
    }
    best = {rows: min(t[rows] for t in times.values()) for rows in _SCORED_ROWS}
    return {
        pair: _Score(by_size, limit, max(times[pair][rows] / best[rows] for rows in _SCORED_ROWS), gemm_from)
        for pair, (by_size, limit, gemm_from) in reads.items()
    }


def _ranking(scores: Mapping[Pair, _Score]) -> list[Pair]:
    # Ties go to the more exact format (the table's order: float32 first).
    return sorted(scores, key=lambda pair: (round(scores[pair].worst, 3), MEASURED_QUALITY[pair]))


def _contested(
    step_ms: Mapping[str, Mapping[int, float]],
    spread: Mapping[str, Mapping[int, float]],
    pairs: Sequence[Pair],
    scores: Mapping[Pair, _Score],
    chosen: Pair,
    rival: Pair,
) -> tuple[bool, float]:
    """Whether the noise could hand `rival` the win: does `chosen` still rank first with each figure only `rival`
    reads lowered by that figure's noise? Only the rival's figures move: each figure is a best over rounds, and
    contention only ever adds time, so the chosen format's own bests can only be too slow, never flatter it.
    (Figures both read, as a quantised format's dense copy, move together and cannot tell them apart.) And the
    largest noise among the figures that tell the two apart."""
    own = {(scores[chosen].reads[rows], rows) for rows in _SCORED_ROWS}
    theirs = {(scores[rival].reads[rows], rows) for rows in _SCORED_ROWS}
    shifted = {label: dict(sizes) for label, sizes in step_ms.items()}
    for label, rows in theirs - own:
        shifted[label][rows] /= 1 + spread[label][rows]
    noise = max((spread[label][rows] for label, rows in own ^ theirs), default=0.0)
    return _ranking(_scores(shifted, pairs))[0] != chosen, noise


def _lighter_twin(
    step_ms: Mapping[str, Mapping[int, float]],
    spread: Mapping[str, Mapping[int, float]],
    scores: Mapping[Pair, _Score],
    pair: Pair,
    other: Pair,
) -> bool:
    """Whether `pair` runs `other`'s quantised weights (the same values) with bfloat16 activations where `other`
    runs float32, both within the quality bar, in half the activations' memory (the KV cache, any dense copy), and
    no slower at any scored size once its own figure there is lowered by that figure's noise. A 3B model's
    int4/float32, served by a 2 % lead inside 25 % noise, held 12.2 GB where int4/bfloat16 held 6.6; a lead made of
    one size clear of its noise (the capped 3B's one row: 44.0 against 48.3 ms) stays the faster one's."""
    if not (pair[1] == other[1] != "none" and pair[0] == "bfloat16" and other[0] == "float32"):
        return False
    for rows in _SCORED_ROWS:
        mine, theirs = scores[pair].reads[rows], scores[other].reads[rows]
        if step_ms[mine][rows] / (1 + spread[mine][rows]) > step_ms[theirs][rows]:
            return False
    return True


def _figures(sizes: Mapping[int, float]) -> str:
    return "/".join(f"{sizes[rows]:.1f}" for rows in _SCORED_ROWS)


def _large_note(pair: Pair, score: _Score, step_ms: Mapping[str, Mapping[int, float]]) -> str:
    """What serves a quantised format's steps past its switch: " (its float32 copy above 16 rows)", " (one digit
    above 8 rows: 9.0/20.1/95.3)", or both; one digit's figures where it was timed and serves none."""
    switch, gemm_from = score.limit, score.gemm_from
    if switch in (None, EVERY_STEP):
        return ""
    dense, digit = format_label(pair[0], "none"), one_digit_label(*pair)
    above = "at every size" if switch == 0 else f"above {switch} rows"
    if gemm_from is None:  # one digit's figures, where timed, say why it serves no size
        unused = f"; one digit {_figures(step_ms[digit])}" if digit in step_ms else ""
        return f" (its {pair[0]} copy {above}{unused})" if dense in step_ms else ""
    figures = _figures(step_ms[digit])
    if gemm_from == switch + 1:
        return f" (one digit {above}: {figures})"
    return f" (its {pair[0]} copy {above}, one digit from {gemm_from} rows: {figures})"


def choose(
    step_ms: Mapping[str, Mapping[int, float]],
    pairs: list[Pair],
    spread: Mapping[str, Mapping[int, float]] | None = None,
) -> FormatChoice:
    """The format whose worst ratio to the fastest, at 1 row, 16 rows and a prefill chunk, is smallest, with its
    row switch, its margin over the runner-up and, given each figure's noise (`spread`), whether that margin is
    inside it (provisional). Where that lead is inside the noise over the same quantised weights with bfloat16
    activations, at every scored size, those are served (still provisional): at no measurable cost in speed, half
    the activations' memory."""
    scores = _scores(step_ms, pairs)
    ranking = _ranking(scores)
    chosen, rival = ranking[0], ranking[1] if len(ranking) > 1 else None
    provisional, noise = False, 0.0
    if rival is not None and spread:
        provisional, noise = _contested(step_ms, spread, pairs, scores, chosen, rival)
        if provisional and _lighter_twin(step_ms, spread, scores, rival, chosen):
            chosen, rival = rival, chosen  # its margin over the faster one comes out negative
    dtype, quantization = chosen
    limit, gemm_from = scores[chosen].limit, scores[chosen].gemm_from
    if quantization != "none" and limit == 0 and gemm_from is None:
        quantization, limit = "none", None  # the dense weights won at every size: no reason to hold int4
    figures = []
    for pair in pairs:  # each format's own figures (not those of the dense copy it may switch to)
        label, score = format_label(*pair), scores[pair]
        figures.append(f"{label} {_figures(step_ms[label])}{_large_note(pair, score, step_ms)}")
    reason = f"ms at 1/16 rows/{PREFILL_ROWS}-token prefill: {', '.join(figures)}"
    choice = FormatChoice(dtype, quantization, limit, step_ms, reason, spread=spread or {}, min_gemm_rows=gemm_from)
    if rival is None:
        return choice
    margin = scores[rival].worst / scores[chosen].worst - 1
    return dataclasses.replace(
        choice, runner_up=format_label(*rival), margin=margin, noise=noise, provisional=provisional
    )
