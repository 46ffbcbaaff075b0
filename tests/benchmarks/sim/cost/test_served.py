"""The served step's cost over the profiled one: fitted per mode, charged by the simulator on every step."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from benchmarks.loadgen.trace import TraceRequest
from benchmarks.sim import cli as simulate
from benchmarks.sim.cost.files import save_fitted
from benchmarks.sim.cost.model import StepShape, chunk_attention_pairs, fit_cost_model
from benchmarks.sim.cost.served import (
    ServedCostModel,
    ServedStepExtra,
    load_served_extras,
    served_extra,
    served_load_json,
    with_served_extra,
)
from benchmarks.sim.profiling.engine_replay import AloneReplay
from benchmarks.sim.profiling.served_probe import ServedLoad
from tests.benchmarks.sim.helpers import COST


def test_the_extra_splits_the_schedulers_time_per_step_and_the_servers_per_streamed_token() -> None:
    trace = (TraceRequest(0.0, 40, 96, 96),) * 24
    load = ServedLoad(8, trace, span_s=10.0)
    alone = AloneReplay(span_s=8.75, busy_s=8.7, engine_s=8.6, steps=400, generated_tokens=2304)
    extra = served_extra(load, alone)
    assert extra.const_s == pytest.approx(0.1 / 400)  # the replay's steps beyond Engine.step, idle left out
    assert extra.per_row_s == pytest.approx(1.25 / 2304)  # the served span's excess, per streamed token
    assert served_load_json(load, alone, extra)["alone"]["steps"] == 400


def test_a_served_run_faster_than_the_replay_adds_nothing() -> None:
    load = ServedLoad(8, (TraceRequest(0.0, 40, 96, 96),), span_s=8.0)
    assert served_extra(load, AloneReplay(8.5, 8.5, 8.5, 300, 96)) == ServedStepExtra(0.0, 0.0)
    with pytest.raises(ValueError, match="ran no steps"):
        served_extra(load, AloneReplay(0.0, 0.0, 0.0, 0, 0))
    with pytest.raises(ValueError, match="finite and >= 0"):
        ServedStepExtra(-0.001, 0.0)


def test_the_served_model_charges_per_row_that_emits_a_token() -> None:
    served = ServedCostModel(COST, ServedStepExtra(0.002, 0.001), "continuous")
    chunk = StepShape(num_seqs=3, num_tokens=130, num_sampled=2, attention_pairs=5000, kv_tokens=200)
    assert served.step_time(chunk) == pytest.approx(COST.step_time(chunk) + 0.002 + 2 * 0.001)
    assert served.step_time(chunk, idle_s=5.0) - COST.step_time(chunk, idle_s=5.0) == pytest.approx(0.004)
    assert "served continuous step" in served.label
    assert with_served_extra(COST, {"continuous": ServedStepExtra(0.002, 0.001)}, "dynamic") is COST


def decode_shape(rows: int, context: int) -> StepShape:
    """A step of `rows` sequences, each decoding one token after `context` cached ones."""
    return StepShape(rows, rows, rows, rows * chunk_attention_pairs(context, 1), rows * (context + 1))


def _cost_file(path: Path, steps: Mapping[str, object]) -> Path:
    shapes = [decode_shape(b, c) for b in (1, 2, 4, 8) for c in (16, 64, 256)]
    shapes += [StepShape(1, t, 1, t * (t + 1) // 2, t) for t in (8, 32, 128)]
    save_fitted(fit_cost_model(shapes, [COST.step_time(s) for s in shapes], "test"), path, {"served": steps})
    return path


def test_simulate_charges_each_modes_served_load_and_can_leave_it_out(tmp_path: Path) -> None:
    """Only the mode whose served steps cost more slows down; its decisions (steps taken) stay the same."""
    steps = {"load": {"continuous": {"seats": 4, "extra": {"const_s": 0.003, "per_row_s": 0.002}}}}
    cost = _cost_file(tmp_path / "cost.json", steps)
    assert load_served_extras(cost) == {"continuous": ServedStepExtra(0.003, 0.002)}
    docs = {}
    for name, extra_flags in (("served", []), ("bare", ["--no-served-load"])):
        out = tmp_path / name
        argv = ["--cost-model", str(cost), "--num-prompts", "16", "--seats", "4", "--request-rate", "inf"]
        assert simulate.main([*argv, *extra_flags, "--out", str(out)]) == 0
        docs[name] = json.loads((out / "result.json").read_text())
    served, bare = (docs[n]["runs"] for n in ("served", "bare"))
    assert served["dynamic"]["summary"] == bare["dynamic"]["summary"]  # no served steps measured for dynamic
    assert served["continuous"]["server_metrics"]["steps"] == bare["continuous"]["server_metrics"]["steps"]
    tput = [r["continuous"]["summary"]["output_throughput"] for r in (served, bare)]
    assert tput[0] < tput[1]
    by_mode = docs["served"]["settings"]["cost_model_by_mode"]
    assert "served continuous step +3.00 ms +2.00 ms a row" in by_mode["continuous"]
    assert "served" not in by_mode["dynamic"]


def test_simulate_charges_only_continuous_by_default(tmp_path: Path) -> None:
    """The bus's charge is measured when asked for but applied only when named in --served-load-modes."""
    extra = {"seats": 4, "extra": {"const_s": 0.003, "per_row_s": 0.002}}
    cost = _cost_file(tmp_path / "cost.json", {"load": {"continuous": extra, "dynamic": extra}})
    argv = ["--cost-model", str(cost), "--num-prompts", "16", "--seats", "4", "--request-rate", "inf"]
    by_mode = {}
    for name, flags in (("default", []), ("both", ["--served-load-modes", "continuous,dynamic"])):
        assert simulate.main([*argv, *flags, "--out", str(tmp_path / name)]) == 0
        by_mode[name] = json.loads((tmp_path / name / "result.json").read_text())["settings"]["cost_model_by_mode"]
    assert "served continuous step" in by_mode["default"]["continuous"]
    assert "served" not in by_mode["default"]["dynamic"]
    assert "served dynamic step" in by_mode["both"]["dynamic"]
    with pytest.raises(SystemExit) as exit_info:
        simulate.main([*argv, "--served-load-modes", "continuous,bus", "--out", str(tmp_path / "bad")])
    assert exit_info.value.code == 2


def test_a_malformed_served_load_section_is_refused(tmp_path: Path) -> None:
    cost = _cost_file(tmp_path / "cost.json", {"load": {"continuous": {"extra": {"fixed": 1}}}})
    with pytest.raises(ValueError, match=r"served\.load"):
        load_served_extras(cost)
