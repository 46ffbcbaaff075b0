"""`batchserve formats` (api/formats.py): the cached weight-format choices with their figures, and `--reprobe`,
which measures a model's formats again now, driven in-process against a cache folder of the test's own."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from api.cli import main
from api.runtime.format_choice import write_entry
from api.runtime.format_rule import choose
from engine.weights.checkpoints import CACHE_DIR_ENV

PAIRS = [("bfloat16", "none"), ("bfloat16", "int4")]
STEP_MS = {
    "bfloat16": {1: 20.0, 4: 22.0, 8: 24.0, 16: 30.0, 32: 45.0, 128: 200.0},
    "int4/bfloat16": {1: 10.0, 4: 14.0, 8: 23.0, 16: 45.0, 32: 90.0, 128: 900.0},
}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    main(argv)
    return capsys.readouterr().out


def test_formats_says_where_nothing_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert f"no weight-format choice cached in {tmp_path / 'format-choice'}" in run(["formats"], capsys)


def test_formats_lists_each_cached_choice_with_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    entry = tmp_path / "format-choice" / "0123.json"
    write_entry(entry, choose(STEP_MS, PAIRS), "/models/m.gguf", "a CPU; kernels x; torch y; 2 threads")
    (tmp_path / "format-choice" / "4567.json").write_text("{}")  # an older version's: said, not fatal
    out = run(["formats"], capsys)
    assert str(entry) in out and "model     /models/m.gguf" in out
    assert "chosen    int4/bfloat16, quantised up to 8 rows, 100% ahead of bfloat16" in out
    assert "int4/bfloat16 10.0/45.0/900.0 (its bfloat16 copy above 8 rows)" in out
    assert "a CPU; kernels x; torch y; 2 threads" in out
    assert "4567.json\n  unreadable, or an older version's" in out


@pytest.mark.slow
def test_formats_reprobe_measures_again_even_where_a_choice_is_cached(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The real probe on the tiny model: whether its lead clears the noise depends on this machine, so either outcome
    # (settled, or kept as provisional) is checked for what it says.
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="batchserve.loader"):
            out = run(["formats", "--reprobe", "--model", str(tiny_gguf)], capsys)
        lines = [record.getMessage() for record in caplog.records]
        assert any("measuring weight formats once for this CPU: round 1 of " in line for line in lines)
        (said,) = [line for line in lines if "chosen by auto" in line]
        cached = list((tmp_path / "format-choice").glob("*.json"))
        assert len(cached) == 1 and str(cached[0]) in out and str(tiny_gguf) in out
        assert ("provisional: measured again" in out) == ("provisionally" in said)
