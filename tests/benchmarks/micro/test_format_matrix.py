"""The format matrix times every format in alternating rounds, so a machine that drifts steadily during the run
does not favour the first or the last format."""

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.micro import format_matrix


def test_a_steady_drift_cancels_and_auto_is_judged_against_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_load(path, dtype, quantization):
        return SimpleNamespace(weight_format=SimpleNamespace(label=f"{quantization}/{dtype}"))

    clock = itertools.count()  # every timing reads 1 ms more than the one before: a linear drift

    def fake_time(loaded, rows, repeats, max_quantized_rows, min_gemm_rows):
        now = float(next(clock))
        return {n: now for n in (*rows, format_matrix.PREFILL_ROWS)}  # time_steps adds the prefill

    monkeypatch.setattr(format_matrix, "load_model", fake_load)
    monkeypatch.setattr(
        format_matrix,
        "load_auto",
        lambda: SimpleNamespace(
            weight_format=SimpleNamespace(label="int4/bfloat16"),
            measured_max_quantized_rows=8,
            measured_min_gemm_rows=9,
        ),
    )
    monkeypatch.setattr(format_matrix, "time_steps", fake_time)
    assert format_matrix.main(["--out", str(tmp_path), "--rounds", "4"]) == 0
    document = json.loads((tmp_path / "result.json").read_text())
    medians = {label: times["1"] for label, times in document["step_ms"].items()}
    assert len(medians) == len(format_matrix.COMBINATIONS) + 1
    assert set(medians.values()) == {13.5}  # 7 formats, 4 rounds: the same median whatever the position
    assert all(v["within"] and v["auto_over_fastest"] == 1.0 for v in document["auto_vs_fastest"].values())
    assert document["rounds"] == 4
    assert document["auto"] == {"format": "int4/bfloat16", "max_quantized_rows": 8, "min_gemm_rows": 9}
