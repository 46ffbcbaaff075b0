"""`python -m benchmarks fit-cost --refit OLD --out NEW`: measures nothing, writes the refit, reports a bad file as a
usage error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim.cost.files import load_fitted, save_fitted
from benchmarks.sim.cost.model import fit_cost_model
from benchmarks.sim.profiling.cli import main
from tests.benchmarks.sim.cost.helpers import TRUE, older_profile, profile_grid


def test_fit_cost_refit_writes_the_refit_and_its_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    older_profile(tmp_path / "older.json", switch=None)
    assert main(["--refit", str(tmp_path / "older.json"), "--out", str(tmp_path / "new.json")]) == 0
    model = load_fitted(tmp_path / "new.json")
    assert model.step_time(profile_grid()[-1]) == pytest.approx(TRUE.step_time(profile_grid()[-1]), rel=1e-6)
    assert "--refit" in json.loads((tmp_path / "new.json").read_text())["refit"]["command"]
    assert "ms per M KV tokens" in capsys.readouterr().out


def test_fit_cost_refit_of_a_file_without_points_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = fit_cost_model(profile_grid(), [TRUE.step_time(s) for s in profile_grid()], source="no points")
    save_fitted(report, tmp_path / "bare.json", {"points": []})
    with pytest.raises(SystemExit) as exited:
        main(["--refit", str(tmp_path / "bare.json"), "--out", str(tmp_path / "new.json")])
    assert exited.value.code == 2
    assert "bare.json holds no measured points" in capsys.readouterr().err
    assert not (tmp_path / "new.json").exists()
