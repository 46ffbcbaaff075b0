"""The simulator's step-cost models: the fit recovers known coefficients; the GPU roofline behaves as a roofline."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from transformers import LlamaConfig

from benchmarks.sim.cost.files import load_fitted, save_fitted
from benchmarks.sim.cost.model import (
    COLD_AFTER_S,
    FittedCostModel,
    StepShape,
    SwitchedCostModel,
    chunk_attention_pairs,
    fit_cost_model,
)
from benchmarks.sim.cost.roofline import BUILTIN_CONFIGS, GPUS, RooflineCostModel, load_model_shape
from benchmarks.sim.profiling.refit import refit
from tests.benchmarks.sim.cost.helpers import FIELDS, TRUE, older_profile, profile_grid


def test_fit_recovers_known_coefficients_exactly_from_noise_free_steps() -> None:
    shapes = profile_grid()
    report = fit_cost_model(shapes, [TRUE.step_time(s) for s in shapes], source="synthetic")
    fitted = report.model
    assert isinstance(fitted, FittedCostModel)  # one regime: no switch_tokens
    assert fitted.knee_tokens == TRUE.knee_tokens
    for field in FIELDS:
        assert getattr(fitted, field) == pytest.approx(getattr(TRUE, field), rel=1e-6), field
    assert report.mean_abs_pct_error < 1e-6 and report.r_squared > 0.999999


def test_fit_recovers_coefficients_within_tolerance_from_noisy_steps() -> None:
    shapes = profile_grid()
    rng = np.random.default_rng(7)
    times = [TRUE.step_time(s) * (1 + 0.03 * rng.standard_normal()) for s in shapes]
    fitted = fit_cost_model(shapes, times, source="synthetic, 3 % noise").model
    assert isinstance(fitted, FittedCostModel)  # one regime: no switch_tokens
    assert fitted.const_s == pytest.approx(TRUE.const_s, rel=0.1)
    assert fitted.per_token_over_knee_s == pytest.approx(TRUE.per_token_over_knee_s, rel=0.1)
    assert fitted.per_attention_mpair_s == pytest.approx(TRUE.per_attention_mpair_s, rel=0.15)
    # Predictions, the thing the simulator uses, stay within a few percent everywhere on the grid.
    worst = max(abs(fitted.step_time(s) - TRUE.step_time(s)) / TRUE.step_time(s) for s in shapes)
    assert worst < 0.05


def test_fit_never_returns_negative_coefficients() -> None:
    shapes = profile_grid()
    # Step time that falls with tokens cannot be fitted by a cost that grows; the fit clamps, not extrapolates.
    times = [0.05 + 0.001 * s.num_seqs for s in shapes]
    fitted = fit_cost_model(shapes, times, source="synthetic").model
    assert isinstance(fitted, FittedCostModel)  # one regime: no switch_tokens
    assert min(fitted.const_s, fitted.per_token_s, fitted.per_seq_s, fitted.per_attention_mpair_s) >= 0
    assert fitted.step_time(shapes[0]) > 0


def test_fitted_model_round_trips_through_cost_json(tmp_path: Path) -> None:
    shapes = profile_grid()
    report = fit_cost_model(shapes, [TRUE.step_time(s) for s in shapes], source="round trip")
    save_fitted(report, tmp_path / "cost.json", {"points": []})
    assert load_fitted(tmp_path / "cost.json") == report.model


def test_a_cost_json_fitted_before_sampled_positions_and_kv_reads_were_features_loads_them_as_zero(
    tmp_path: Path,
) -> None:
    report = fit_cost_model(profile_grid(), [TRUE.step_time(s) for s in profile_grid()], source="older")
    save_fitted(report, tmp_path / "cost.json", {"points": []})
    document = json.loads((tmp_path / "cost.json").read_text())
    del document["model"]["per_sampled_s"], document["model"]["per_kv_mtoken_s"]  # as older cost.json files
    (tmp_path / "cost.json").write_text(json.dumps(document))
    older = load_fitted(tmp_path / "cost.json")
    assert isinstance(older, FittedCostModel) and older.per_sampled_s == older.per_kv_mtoken_s == 0.0
    assert older == dataclasses.replace(report.model, per_sampled_s=0.0, per_kv_mtoken_s=0.0)


def test_refit_fits_the_current_form_to_a_profiles_points_and_keeps_what_it_measured(tmp_path: Path) -> None:
    shapes = older_profile(tmp_path / "older.json", switch=None)
    report = refit(tmp_path / "older.json", tmp_path / "new.json", "fit-cost --refit older.json --out new.json")
    model = load_fitted(tmp_path / "new.json")
    assert model == report.model and isinstance(model, FittedCostModel)
    for field in FIELDS:
        assert getattr(model, field) == pytest.approx(getattr(TRUE, field), rel=1e-6), field
    assert model.cold_step_s == 0.005  # measured after idle: not in the points, carried over
    document = json.loads((tmp_path / "new.json").read_text())
    assert document["served"] == {"outside_step_s": 0.004}
    assert document["refit"]["from"] == str(tmp_path / "older.json")
    assert document["refit"]["profile_command"] == "fit-cost --out older.json"
    assert [p["fitted_ms"] for p in document["points"]] == pytest.approx([1e3 * TRUE.step_time(s) for s in shapes])


def test_refit_keeps_a_switched_profiles_regimes_and_their_cold_steps(tmp_path: Path) -> None:
    older_profile(tmp_path / "older.json", switch=8)
    model = refit(tmp_path / "older.json", tmp_path / "new.json", "refit").model
    assert isinstance(model, SwitchedCostModel) and model.max_small_tokens == 8
    assert (model.small.cold_step_s, model.large.cold_step_s) == (0.002, 0.005)
    assert model.large.per_kv_mtoken_s == pytest.approx(TRUE.per_kv_mtoken_s, rel=1e-6)


def test_a_profile_without_verify_points_leaves_sampled_positions_to_the_row_cost() -> None:
    # Every step samples as many positions as it holds sequences: nothing tells the two costs apart, so the fit keeps
    # the sampled position's cost in the row's rather than halving it between them.
    shapes = profile_grid(verify=False)
    assert all(s.num_sampled == s.num_seqs for s in shapes)
    fitted = fit_cost_model(shapes, [TRUE.step_time(s) for s in shapes], source="no verify points").model
    assert isinstance(fitted, FittedCostModel) and fitted.per_sampled_s == 0.0
    assert fitted.per_seq_s == pytest.approx(TRUE.per_seq_s + TRUE.per_sampled_s, rel=1e-6)
    assert fitted.per_kv_mtoken_s == pytest.approx(TRUE.per_kv_mtoken_s, rel=1e-6)  # prompt chunks tell K from A


def test_refit_takes_the_served_prefills_cold_cost_against_the_new_fit(tmp_path: Path) -> None:
    older_profile(tmp_path / "older.json", switch=None, served={"prompt_tokens": 30, "prefill_s": 0.05})
    old = load_fitted(tmp_path / "older.json")
    model = refit(tmp_path / "older.json", tmp_path / "new.json", "refit").model
    lone = StepShape(1, 30, 1, chunk_attention_pairs(0, 30), 30)
    # The profile set it as served minus the old warm time; the same served time less the new warm time.
    assert model.step_time(lone) != pytest.approx(old.step_time(lone))
    assert isinstance(old, FittedCostModel) and isinstance(model, FittedCostModel)
    assert model.cold_step_s == pytest.approx(old.cold_step_s + old.step_time(lone) - model.step_time(lone))


def test_refit_of_a_point_without_its_shape_is_an_error_naming_the_file(tmp_path: Path) -> None:
    older_profile(tmp_path / "older.json", switch=None)
    document = json.loads((tmp_path / "older.json").read_text())
    del document["points"][0]["shape"]
    (tmp_path / "older.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"older\.json: a point without a step shape"):
        refit(tmp_path / "older.json", tmp_path / "new.json", "refit")


def test_refit_of_a_file_without_points_is_an_error_naming_it(tmp_path: Path) -> None:
    report = fit_cost_model(profile_grid(), [TRUE.step_time(s) for s in profile_grid()], source="no points")
    save_fitted(report, tmp_path / "bare.json", {"points": []})
    with pytest.raises(ValueError, match=r"bare\.json holds no measured points"):
        refit(tmp_path / "bare.json", tmp_path / "new.json", "refit")


# The engine's row switch (int4 up to 10 tokens a step, a dense copy past it): past the switch the fixed cost
# jumps and the per-token cost drops, which no single non-negative fit of the form can follow.
SWITCHED = SwitchedCostModel(
    small=FittedCostModel(0.006, 0.0025, 0.0, 0, 0.0002, 0.3),
    large=FittedCostModel(0.025, 0.00025, 0.0, 0, 0.0004, 0.35),
    max_small_tokens=10,
)


def test_switched_fit_recovers_each_regime_and_beats_one_smooth_fit() -> None:
    shapes = profile_grid()
    times = [SWITCHED.step_time(s) for s in shapes]
    report = fit_cost_model(shapes, times, source="synthetic", switch_tokens=10)
    assert isinstance(report.model, SwitchedCostModel) and report.model.max_small_tokens == 10
    for shape in shapes:
        assert report.model.step_time(shape) == pytest.approx(SWITCHED.step_time(shape), rel=1e-6)
    smooth = fit_cost_model(shapes, times, source="synthetic")
    assert smooth.mean_abs_pct_error > 0.05 > report.mean_abs_pct_error


def test_switched_model_round_trips_through_cost_json(tmp_path: Path) -> None:
    shapes = profile_grid()
    report = fit_cost_model(shapes, [SWITCHED.step_time(s) for s in shapes], "round trip", switch_tokens=10)
    save_fitted(report, tmp_path / "cost.json", {})
    loaded = load_fitted(tmp_path / "cost.json")
    assert isinstance(loaded, SwitchedCostModel)
    assert all(loaded.step_time(s) == pytest.approx(report.model.step_time(s)) for s in shapes)


def test_a_switch_at_one_token_fits_the_batch_1_steps_on_their_own() -> None:
    # `auto` capped to AVX2 on a Zen 5 ran two digits at 1 row and one digit from 2: below the switch only the
    # grid's three 1-token steps, which tell const and attention apart and nothing else (fit-cost raised here).
    switched = SwitchedCostModel(
        small=FittedCostModel(0.004, 0.0, 0.0, 0, 0.0, 0.5), large=SWITCHED.large, max_small_tokens=1
    )
    shapes = profile_grid()
    assert sum(s.num_tokens <= 1 for s in shapes) == 3
    report = fit_cost_model(shapes, [switched.step_time(s) for s in shapes], "switch at 1", switch_tokens=1)
    assert isinstance(report.model, SwitchedCostModel) and report.model.max_small_tokens == 1
    for shape in shapes:
        assert report.model.step_time(shape) == pytest.approx(switched.step_time(shape), rel=1e-6)


def test_switched_fit_needs_enough_points_on_each_side_it_has() -> None:
    grid = profile_grid()
    shapes = [s for s in grid if s.num_tokens <= 10] + [s for s in grid if s.num_tokens > 10][:2]
    with pytest.raises(ValueError, match="each side"):
        fit_cost_model(shapes, [SWITCHED.step_time(s) for s in shapes], "two past the switch", switch_tokens=10)


def test_a_switch_past_every_measured_step_fits_one_regime() -> None:
    # The AVX2 cap keeps the quantised weights at every row count: its switch is the largest int.
    shapes = [s for s in profile_grid() if s.num_tokens <= 10]
    times = [SWITCHED.step_time(s) for s in shapes]
    report = fit_cost_model(shapes, times, "one regime", switch_tokens=2**31 - 1)
    assert isinstance(report.model, FittedCostModel)
    assert report.model == fit_cost_model(shapes, times, "one regime").model


def test_fitted_model_rejects_negative_coefficients() -> None:
    with pytest.raises(ValueError, match="coefficients"):
        dataclasses.replace(TRUE, per_seq_s=-1.0)


def llama_8b_on(gpu: str) -> RooflineCostModel:
    return RooflineCostModel(GPUS[gpu], load_model_shape("llama-3-8b"))


def decode(rows: int, context: int) -> StepShape:
    return StepShape(rows, rows, rows, rows * chunk_attention_pairs(context, 1), rows * (context + 1))


def test_llama_3_8b_shape_has_eight_billion_parameters_and_128_kib_of_kv_per_token() -> None:
    shape = load_model_shape("llama-3-8b")
    assert shape.num_params == pytest.approx(8.03e9, rel=0.01)
    assert shape.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2


def test_model_shape_from_a_config_dir_matches_the_builtin(tmp_path: Path) -> None:
    LlamaConfig(**BUILTIN_CONFIGS["llama-3-8b"]).save_pretrained(tmp_path)
    assert dataclasses.replace(load_model_shape(str(tmp_path)), name="llama-3-8b") == load_model_shape("llama-3-8b")


def test_unknown_model_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a built-in"):
        load_model_shape(str(tmp_path / "missing"))


def test_roofline_is_memory_bound_at_batch_one_on_h100_for_an_8b_model() -> None:
    model = llama_8b_on("h100")
    step = decode(1, 512)
    assert model.bound(step) == "memory"
    # About 15 GB of bf16 weights a step reads (all but the embedding table) at ~80 % of 3.35 TB/s: 5.6 ms, plus
    # the 1 ms step overhead.
    assert model.step_time(step) == pytest.approx(1e-3 + 15.0e9 / (3.35e12 * 0.8), rel=0.02)


def test_roofline_turns_compute_bound_for_a_long_prefill() -> None:
    model = llama_8b_on("h100")
    assert model.bound(StepShape(1, 8192, 1, chunk_attention_pairs(0, 8192), 8192)) == "compute"


def test_roofline_is_monotonic_in_batch_context_and_prefill() -> None:
    for gpu in GPUS:
        model = llama_8b_on(gpu)
        by_batch = [model.step_time(decode(rows, 512)) for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
        by_context = [model.step_time(decode(32, context)) for context in (16, 256, 1024, 4096, 8000)]
        by_prefill = [
            model.step_time(StepShape(1, p, 1, chunk_attention_pairs(0, p), p)) for p in (1, 64, 512, 2048, 8192)
        ]
        for series in (by_batch, by_context, by_prefill):
            assert series == sorted(series), (gpu, series)
        # A GPU decode step costs about the same from batch 1 to a large batch: what makes continuous win there.
        assert by_batch[5] < 1.5 * by_batch[0], gpu


def test_slower_gpus_project_slower_steps_and_smaller_caches() -> None:
    step = decode(16, 1024)
    times = [llama_8b_on(gpu).step_time(step) for gpu in ("h100", "a100", "l4")]
    assert times == sorted(times)
    assert llama_8b_on("h100").kv_cache_tokens() > llama_8b_on("l4").kv_cache_tokens() > 0


def test_a_step_after_idle_pays_its_regimes_cold_cost_and_cost_json_keeps_it(tmp_path: Path) -> None:
    cold = dataclasses.replace(
        SWITCHED,
        small=dataclasses.replace(SWITCHED.small, cold_step_s=0.004),
        large=dataclasses.replace(SWITCHED.large, cold_step_s=0.015),
    )
    decode = StepShape(1, 1, 1, 33, 33)
    prefill = StepShape(1, 40, 1, chunk_attention_pairs(0, 40), 40)
    for shape, extra in ((decode, 0.004), (prefill, 0.015)):
        warm = SWITCHED.step_time(shape)
        assert cold.step_time(shape) == cold.step_time(shape, idle_s=COLD_AFTER_S * 0.99) == warm  # back to back
        assert cold.step_time(shape, idle_s=COLD_AFTER_S) == pytest.approx(warm + extra)
        assert cold.step_time(shape, idle_s=math.inf) == pytest.approx(warm + extra)
    report = fit_cost_model(profile_grid(), [SWITCHED.step_time(s) for s in profile_grid()], "t", switch_tokens=10)
    save_fitted(dataclasses.replace(report, model=cold), tmp_path / "cost.json", {})
    assert load_fitted(tmp_path / "cost.json") == cold
    # A cost.json written before the cold term loads with none.
    document = json.loads((tmp_path / "cost.json").read_text())
    for regime in ("small", "large"):
        del document["model"][regime]["cold_step_s"]
    (tmp_path / "old.json").write_text(json.dumps(document))
    assert load_fitted(tmp_path / "old.json") == SWITCHED
    with pytest.raises(ValueError, match="finite and >= 0"):
        dataclasses.replace(SWITCHED.small, cold_step_s=-0.001)
