"""The simulator's model of speculation: vLLM's synthetic acceptance and the predicted break-even batch size."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from benchmarks.loadgen.trace import TraceRequest
from benchmarks.sim.cost.model import FittedCostModel
from benchmarks.sim.cost.speculation import accepted_drafts, break_even, crossing, expected_emitted, speedups
from benchmarks.sim.engine import SyntheticDrafter
from benchmarks.sim.run import SimSettings, simulate_trace
from benchmarks.sim.spec_break_even import main
from benchmarks.sim.spec_check import measured_interval, points, rate_from_counters
from engine.config import EngineConfig
from engine.spec.config import SpeculativeConfig
from scheduler.config import Mode, SchedulerConfig

# A CPU-like step: a large fixed cost (reading the weights) and a per-token cost, so a few rows are nearly free.
CPU = FittedCostModel(
    const_s=0.010, per_token_s=0.001, per_token_over_knee_s=0.0, knee_tokens=0, per_seq_s=0.0, per_attention_mpair_s=0.0
)


def test_sampled_acceptance_stops_at_the_first_rejection_and_matches_its_mean() -> None:
    draw = random.Random(0).random

    def sample_emitted(rate: float, k: int, rows: int) -> np.ndarray:
        return np.array([accepted_drafts(draw, rate, k) + 1 for _ in range(rows)])

    emitted = sample_emitted(0.6, 4, 200_000)
    assert emitted.min() == 1 and emitted.max() == 5
    assert emitted.mean() == pytest.approx(expected_emitted(0.6, 4), rel=0.01)
    # P(exactly j accepted) = R**j (1 - R) for j < k: the first rejection ends the row's drafts.
    assert np.mean(emitted == 2) == pytest.approx(0.6 * 0.4, abs=0.005)
    assert np.mean(emitted == 5) == pytest.approx(0.6**4, abs=0.005)
    assert (sample_emitted(0.0, 4, 100) == 1).all() and (sample_emitted(1.0, 3, 100) == 4).all()


def test_break_even_is_where_verifying_costs_more_than_it_emits() -> None:
    # k=4, R=0.5: 1.9375 tokens per row per step; plain b rows cost 10+b ms, speculative 10+5b ms.
    # 1.9375 (10+b) <= 10+5b once b >= 9.375/3.0625 = 3.06: batch 4.
    batches = [1, 2, 3, 4, 8, 32]
    assert break_even(CPU, 0.5, 4, 0, batches) == 4
    ratios = speedups(CPU, 0.5, 4, 0, batches)
    assert ratios[0] > 1.0 and (np.diff(ratios) < 0).all()
    assert break_even(CPU, 0.5, 4, 0, [1, 2, 3]) is None
    # Better acceptance pays at larger batches.
    better = break_even(CPU, 0.9, 4, 0, list(range(1, 65)))
    assert better is not None and better > 4


def test_rows_that_draft_only_sometimes_are_charged_the_expected_step() -> None:
    # Linear cost: the expectation is the cost of the mean step. b=1, D=0.5, R=0.5, k=4: a row emits
    # 1 + 0.5 * 0.9375 tokens a step, and the step costs 10 + 1 + 0.5 * 4 ms against 11 plain.
    assert speedups(CPU, 0.5, 4, 0, [1], draft_rate=0.5)[0] == pytest.approx(1.46875 * 11 / 13)
    # Past a knee the binomial weighting matters: two rows, each drafting with chance 0.5, make steps of 2, 6 or
    # 10 tokens with chances 1/4, 1/2, 1/4: 12, 20 and 32 ms (10 ms + 1 ms a token + 2 ms a token past 4).
    kneed = FittedCostModel(0.010, 0.001, 0.002, 4, 0.0, 0.0)
    assert speedups(kneed, 0.5, 4, 0, [2], draft_rate=0.5)[0] == pytest.approx(1.46875 * 12 / 21)
    batches = [1, 2, 4, 8, 16]
    assert np.allclose(speedups(CPU, 0.5, 4, 64, batches, draft_rate=1.0), speedups(CPU, 0.5, 4, 64, batches))
    assert np.allclose(speedups(kneed, 0.5, 4, 64, batches, draft_rate=0.0), 1.0)


def test_the_synthetic_drafter_drafts_at_its_rate() -> None:
    drafter = SyntheticDrafter(0.3, seed=1)
    drafted = [drafter(None, 4, None) for _ in range(20_000)]  # type: ignore[arg-type]
    assert {len(d) for d in drafted} == {0, 4}
    assert np.mean([bool(d) for d in drafted]) == pytest.approx(0.3, abs=0.015)
    always = SyntheticDrafter()
    assert all(always(None, 3, None) == [0, 0, 0] for _ in range(100))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="draft_rate"):
        SyntheticDrafter(1.5)


def test_command_prints_the_break_even_batch(tmp_path, capsys) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"model": {f: getattr(CPU, f) for f in CPU.__dataclass_fields__}}))
    main(["--cost-model", str(path), "--acceptance-rate", "0.5", "--k", "4", "--context", "0", "--batches", "1,4,2,3"])
    out = json.loads(capsys.readouterr().out)
    assert out["break_even_batch"] == 4 and [r["batch"] for r in out["by_batch"]] == [1, 2, 3, 4]
    with pytest.raises(SystemExit):
        main(["--cost-model", str(path), "--acceptance-rate", "1.5"])


def test_crossing_interpolates_where_the_speedup_falls_to_one() -> None:
    assert crossing([1, 8], [1.3, 0.8]) == pytest.approx(1 + 0.3 / 0.5 * 7)
    assert crossing([2, 4], [0.9, 0.5]) == 2.0 and crossing([1, 2], [1.5, 1.1]) is None


def test_the_break_even_grows_with_acceptance_and_the_speedup_falls_with_the_batch() -> None:
    batches = list(range(1, 65))
    evens = [break_even(CPU, rate, 4, 256, batches) or 65 for rate in (0.2, 0.4, 0.6, 0.8, 0.95)]
    assert evens == sorted(evens) and evens[0] < evens[-1]
    for k in (1, 2, 4, 8):
        assert (np.diff(speedups(CPU, 0.7, k, 256, batches)) <= 1e-12).all()
    # Verifying nothing right costs more at every batch; every draft right pays where a step is nearly free.
    assert break_even(CPU, 0.0, 4, 256, batches) == 1 and speedups(CPU, 0.99, 4, 0, [1])[0] > 3


def _simulated_speedup(batch: int, rate: float, draft_rate: float = 1.0) -> float:
    spec = SpeculativeConfig(4, draft_length="fixed")
    engine = EngineConfig(max_rows=batch, kv_cache_tokens=batch * 512, max_model_len=512)
    trace = [TraceRequest(0.0, 16, 256) for _ in range(batch)]
    throughput = []
    for config in (None, spec):
        scheduler = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=batch, speculative=config)
        settings = SimSettings(scheduler, engine, CPU, acceptance_rate=rate, draft_rate=draft_rate)
        run = simulate_trace(trace, settings, "run", 1.0)
        throughput.append(run.summary.output_throughput)
    return throughput[1] / throughput[0]


def test_the_prediction_is_the_simulators_break_even() -> None:
    # The simulator charges a verify step as the prediction does: its measured speedups cross 1 where the cost
    # model's do (within a batch: its runs also hold prompt steps and the answers' last, shorter steps). With a
    # draft rate below 1 the simulator's drafter skips rows at random, the prediction takes the expectation.
    batches = [1, 2, 3, 4, 5, 6, 8, 10, 12]
    for rate, drafting in ((0.5, 1.0), (0.7, 1.0), (0.7, 0.4)):  # break-even near 3.1, 7.9 and 5.3
        predicted = crossing(batches, speedups(CPU, rate, 4, 16 + 128, batches, drafting).tolist())
        simulated = crossing(batches, [_simulated_speedup(b, rate, drafting) for b in batches])
        assert predicted is not None and simulated is not None
        assert simulated == pytest.approx(predicted, abs=1.0), (rate, drafting)


def _ab_folder(
    root: Path, seats: int, plain: float, spec: float, drafts: float | None = 250, rounds: list[float] | None = None
) -> Path:
    """An `ab --speculation both` folder at R = 0.6 with 1,000 draft tokens; `drafts` rows drafted of 250 sampling
    row-steps (None: a run from before the drafts counter); `rounds`: the spec run's throughput round by round
    (`ab --rounds`), the plain run's `plain` in each."""
    folder = root / f"mixed-{seats}"
    folder.mkdir()
    config = '{"method": "ngram", "num_speculative_tokens": 4, "draft_length": "fixed"}'
    settings = {"workload": "mixed", "num_prompts": 8, "seed": 0, "seats": seats, "max_concurrency": seats,
                "request_rate": "inf", "speculative_config": config}  # fmt: skip

    def run(label: str, tput: float, metrics: dict) -> dict:
        summary = {"label": label, "completed": 8, "input_tokens": 400, "output_tokens": 800, "output_throughput": tput}
        return {"label": label, "summary": summary, "server_metrics": metrics}

    accepted = 1000 * (expected_emitted(0.6, 4) - 1) / 4  # R = 0.6
    counters = {"draft_tokens": 1000, "accepted_tokens": accepted, "generation_tokens": accepted + 250}
    if drafts is not None:
        counters["drafts"] = drafts
    runs = {
        "continuous": run("continuous", plain, {"draft_tokens": 0, "accepted_tokens": 0}),
        "continuous-spec": run("continuous-spec", spec, counters),
    }
    document: dict = {"settings": settings, "runs": runs}
    if rounds is not None:
        targets = {"continuous": {"output_tok_s": [plain] * len(rounds)}, "continuous-spec": {"output_tok_s": rounds}}
        document["rounds"] = {"base": "continuous", "targets": targets}
    (folder / "result.json").write_text(json.dumps(document))
    return folder


def test_check_sets_the_measured_break_even_beside_the_simulated(tmp_path, capsys) -> None:
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"model": {f: getattr(CPU, f) for f in CPU.__dataclass_fields__}}))
    folders = [_ab_folder(tmp_path, 1, 100.0, 130.0), _ab_folder(tmp_path, 8, 400.0, 320.0)]
    assert rate_from_counters(1000, 1000 * (expected_emitted(0.6, 4) - 1) / 4, 4) == pytest.approx(0.6)
    main(["--cost-model", str(cost), "--check", *map(str, folders)])
    out = capsys.readouterr().out
    assert (
        "| mixed-1 | continuous | 1 | 0.60 | 1.00 | 1.300x |" in out
        and "| mixed-8 | continuous | 8 | 0.60 | 1.00 | 0.800x |" in out
    )
    # measured: 1.3x at 1, 0.8x at 8, so 1 + 7 * 0.3 / 0.5; the simulator's and the cost model's beside it
    line = next(line for line in out.splitlines() if line.startswith("continuous: break-even"))
    assert line.startswith("continuous: break-even concurrency measured 5.2, simulated ")
    # R = 0.6, k = 4 on the CPU model: 1.4x at 1 and 0.83x at 8, so 6.6 between them (3.4 on every batch size)
    assert line.endswith("cost model alone 6.6 (between the same concurrencies)")
    with pytest.raises(SystemExit):
        main(["--cost-model", str(cost), "--check", str(tmp_path)])  # no result.json there


def test_a_profile_without_verify_steps_is_named_in_a_note(tmp_path, capsys) -> None:
    cost = tmp_path / "cost.json"
    model = {f: getattr(CPU, f) for f in CPU.__dataclass_fields__}
    cost.write_text(json.dumps({"model": model, "points": [{"drafts": 0}]}))
    main(["--cost-model", str(cost), "--acceptance-rate", "0.6"])
    assert "timed no verify steps" in capsys.readouterr().err
    cost.write_text(json.dumps({"model": model, "points": [{"drafts": 0}, {"drafts": 4}]}))
    main(["--cost-model", str(cost), "--acceptance-rate", "0.6"])
    assert "verify steps" not in capsys.readouterr().err


def test_a_loop_over_fewer_requests_than_seats_is_placed_at_its_requests(tmp_path) -> None:
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"model": {f: getattr(CPU, f) for f in CPU.__dataclass_fields__}}))
    folder = _ab_folder(tmp_path, 16, 400.0, 320.0)  # 16 seats, 8 requests: at most 8 in the server
    assert [p.concurrency for p in points(cost, [folder], None)] == [8]


def test_check_takes_the_draft_rate_from_the_runs_counters(tmp_path) -> None:
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"model": {f: getattr(CPU, f) for f in CPU.__dataclass_fields__}}))
    counted = _ab_folder(tmp_path, 1, 100.0, 110.0, drafts=100)  # 100 rows of 250 drafted: D = 0.4
    (tmp_path / "older").mkdir()
    older = _ab_folder(tmp_path / "older", 1, 100.0, 110.0, drafts=None)  # 1,000 draft tokens / k = 250 rows: D = 1
    found = points(cost, [counted, older], None)
    assert [p.draft_rate for p in found] == [pytest.approx(0.4), pytest.approx(1.0)]
    context = round(400 / 8 + 800 / 16)
    assert found[0].predicted == pytest.approx(speedups(CPU, found[0].rate, 4, context, [1], 0.4)[0])
    assert found[0].predicted < found[1].predicted  # at one row, verifying is nearly free: drafting more pays more
    assert points(cost, [counted], None, draft_rate=1.0)[0].predicted == pytest.approx(found[1].predicted)


def test_the_measured_break_even_carries_the_spread_of_its_rounds() -> None:
    # Rounds that agree pin it: 1.3x at 1, 0.8x at 8 in every round, so 5.2 whichever rounds are drawn.
    assert measured_interval([1, 8], [[1.3, 1.3, 1.3], [0.8, 0.8, 0.8]]) == pytest.approx((5.2, 5.2))
    assert measured_interval([1, 8], [[1.3], [0.8]]) is None  # one round: no spread to resample
    # A flat curve near 1 (speculation neither pays nor costs): the rounds alone move it from the first batch to
    # past the last.
    low, high = measured_interval([1, 2, 4, 8], [[1.06, 0.95, 1.01], [0.97, 1.04, 1.0], [1.03, 0.96], [1.02, 0.99]])
    assert low == 1.0 and math.isinf(high)


def test_check_shows_the_interval_where_the_runs_had_rounds(tmp_path, capsys) -> None:
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"model": {f: getattr(CPU, f) for f in CPU.__dataclass_fields__}}))
    folders = [
        _ab_folder(tmp_path, 1, 100.0, 130.0, rounds=[125.0, 130.0, 135.0]),
        _ab_folder(tmp_path, 8, 400.0, 320.0, rounds=[300.0, 320.0, 340.0]),
    ]
    found = points(cost, folders, None)
    assert [p.round_ratios for p in found] == [pytest.approx((1.25, 1.3, 1.35)), pytest.approx((0.75, 0.8, 0.85))]
    main(["--cost-model", str(cost), "--check", *map(str, folders)])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("continuous: break-even"))
    low, high = measured_interval([1, 8], [p.round_ratios for p in found])
    assert 1 < low < 5.2 < high < 8
    assert line.startswith(
        f"continuous: break-even concurrency measured 5.2 (90 % of its rounds resampled: {low:.1f} to "
    )
