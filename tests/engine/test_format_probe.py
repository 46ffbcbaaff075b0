"""`auto` measured (engine/format_probe.py): which formats are candidates, how the times choose one and its row
switch, the cache that makes it a first-start cost only, and a real timing run on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.format_probe import EVERY_STEP, MEASURED_ROWS, candidates, choose, load_auto, measured_format, time_steps
from engine.loader import load_model

ALL = [("float32", "none"), ("bfloat16", "none"), ("float32", "int4"), ("bfloat16", "int4")]


def test_candidates_are_the_formats_auto_leaves_open_and_whose_quality_is_measured() -> None:
    assert candidates("auto", "auto", gguf_int4=True, stored_float32=False) == ALL
    assert candidates("auto", "auto", gguf_int4=False, stored_float32=False) == ALL[:2]  # no requantising
    assert candidates("auto", "auto", gguf_int4=False, stored_float32=True) == [("float32", "none")]
    assert candidates("float32", "auto", gguf_int4=True, stored_float32=False) == [ALL[0], ALL[2]]
    assert candidates("auto", "int8", gguf_int4=True, stored_float32=False) == []  # int8's quality: unmeasured here


def _times(one: float, sixteen: float, crossover: int = 8) -> dict[int, float]:
    """A step time that grows from `one` to `sixteen` ms; rows past `crossover` cost a jump (a quantised kernel
    past its sweet spot)."""
    return {
        rows: one + (sixteen - one) * (rows - 1) / 15 + (50.0 if rows > crossover else 0.0) for rows in MEASURED_ROWS
    }


def test_choose_takes_the_smallest_worst_ratio_and_switches_where_the_dense_copy_wins() -> None:
    step_ms = {
        "float32": _times(30, 60, crossover=99),
        "bfloat16": _times(20, 35, crossover=99),
        "int4/float32": _times(9, 60, crossover=99),
        "int4/bfloat16": _times(7, 30, crossover=8),  # fast at few rows, past 8 rows slower than bf16 dense
    }
    choice = choose(step_ms, ALL)
    assert (choice.dtype, choice.quantization, choice.max_quantized_rows) == ("bfloat16", "int4", 8)
    assert "int4/bfloat16 7.0/" in choice.reason


def test_winning_at_the_prefill_chunk_keeps_the_quantised_weights_at_every_size() -> None:
    step_ms = {"bfloat16": _times(20, 190, 99), "int4/bfloat16": _times(14, 60, 99)}
    step_ms["bfloat16"][128] = 1080.0  # dense bf16 without native bf16
    choice = choose(step_ms, [("bfloat16", "none"), ("bfloat16", "int4")])
    assert (choice.label, choice.max_quantized_rows) == ("int4/bfloat16", EVERY_STEP)


def test_choose_drops_quantisation_where_the_dense_weights_win_everywhere() -> None:
    step_ms = {"float32": _times(10, 20, 99), "int4/float32": _times(12, 30, 99)}
    choice = choose(step_ms, [("float32", "none"), ("float32", "int4")])
    assert (choice.label, choice.max_quantized_rows) == ("float32", None)


def test_ties_go_to_the_more_exact_format() -> None:
    same = _times(10, 20, 99)
    choice = choose({"float32": same, "bfloat16": dict(same)}, [("float32", "none"), ("bfloat16", "none")])
    assert choice.label == "float32"


def test_the_choice_is_measured_once_and_then_read_from_the_cache(tmp_path: Path, tiny_checkpoint: Path) -> None:
    measured: list[tuple[str, str]] = []

    def fake(dtype: str, quantization: str) -> dict[int, float]:
        measured.append((dtype, quantization))
        return _times(10 if dtype == "bfloat16" else 20, 40)

    pairs = [("float32", "none"), ("bfloat16", "none")]
    first = measured_format(tiny_checkpoint, pairs, cache_dir=tmp_path, measure=fake)
    again = measured_format(tiny_checkpoint, pairs, cache_dir=tmp_path, measure=fake)
    assert measured == pairs and first == again and first.label == "bfloat16"
    assert len(list((tmp_path / "format-choice").glob("*.json"))) == 1
    other = measured_format(tiny_checkpoint, [*pairs[:1], ("float32", "int4")], cache_dir=tmp_path, measure=fake)
    assert other.label == "float32" and len(measured) == 4  # other candidates: measured anew


def test_time_steps_runs_real_decode_steps_at_each_row_count(tiny_checkpoint: Path) -> None:
    times = time_steps(load_model(tiny_checkpoint), rows=(1, 3), prefill_tokens=20, repeats=2)
    assert set(times) == {1, 3, 20} and all(t > 0 for t in times.values())


def test_a_float32_checkpoint_leaves_auto_nothing_to_measure(tiny_checkpoint: Path, tmp_path: Path) -> None:
    loaded = load_auto(tiny_checkpoint, cache_dir=tmp_path)
    assert loaded.weight_format.dtype == torch.float32 and loaded.measured_max_quantized_rows is None
    assert not (tmp_path / "format-choice").exists()


@pytest.mark.slow
def test_auto_on_the_default_model_picks_a_candidate_and_caches_it() -> None:
    loaded = load_auto()
    assert (loaded.weight_format.label.split("/")[-1], loaded.weight_format.quantization) in [(d, q) for d, q in ALL]
    again = load_auto()
    assert again.weight_format == loaded.weight_format
    assert again.measured_max_quantized_rows == loaded.measured_max_quantized_rows
