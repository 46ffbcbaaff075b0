"""Every mode in the simulator: static batching on the virtual clock (its ticks and its full batches, at exact
times), the real engine's decisions reproduced in static mode, and `simulate --mode all --policy MODULE:CLASS`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from benchmarks.loadgen.trace import TraceRequest
from benchmarks.sim import cli as simulate
from benchmarks.sim.cost.model import FittedCostModel
from benchmarks.sim.run import SimSettings, simulate_trace
from engine.config import EngineConfig
from scheduler.config import Mode, SchedulerConfig
from tests.benchmarks.sim.helpers import assert_same_decisions, requests, with_natural_stops, write_cost

STEP_S = 0.010  # every simulated step costs exactly this: times below are sums of steps and ticks
FLAT = FittedCostModel(
    const_s=STEP_S, per_token_s=0, per_token_over_knee_s=0, knee_tokens=0, per_seq_s=0, per_attention_mpair_s=0
)
SPF = "scheduler.examples.shortest_prompt_first:ShortestPromptFirst"


def _simulate(mode: Mode, trace: list[TraceRequest]) -> list[tuple[float, float, float, float]]:
    """Per request: (arrival, queue time, first token, release), in seconds of the virtual clock."""
    config = SchedulerConfig(mode=mode, max_batch_size=4, batch_timeout_ms=50.0, batch_window_ms=100.0)
    engine = EngineConfig(max_rows=4, kv_cache_tokens=4 * 64, max_model_len=64)
    run = simulate_trace(trace, SimSettings(config, engine, FLAT), mode.value, float("inf"))
    out = []
    for record in run.records:
        assert record.ok and record.output_tokens == 3 and record.server_timings is not None, record
        queue_s = float(record.server_timings["queue_time_ms"]) / 1e3
        assert record.first_token_time is not None
        out.append((record.send_time, queue_s, record.first_token_time, record.end_time))
    return out


# Two requests between the ticks at 0 and 0.1 s, then four at once (a full batch), then one more while they run.
TRACE = [
    TraceRequest(0.03, 4, 3),
    TraceRequest(0.05, 4, 3),
    *[TraceRequest(0.155, 4, 3) for _ in range(4)],
    TraceRequest(0.16, 4, 3),
]


def test_static_partial_batches_leave_at_the_window_ticks_and_full_ones_at_once_on_the_virtual_clock() -> None:
    times = _simulate(Mode.STATIC, TRACE)
    # The partial batch of two leaves at the tick at 0.1 s (ticks count from the server's start, not from an
    # arrival); three 10 ms steps: first token at 0.11, both released together at 0.13.
    assert times[0] == pytest.approx((0.03, 0.07, 0.11, 0.13))
    assert times[1] == pytest.approx((0.05, 0.05, 0.11, 0.13))
    # Four arrive at 0.155 with the seats free: a full batch, it leaves at once, between ticks.
    for full in times[2:6]:
        assert full == pytest.approx((0.155, 0.0, 0.165, 0.185))
    # One arrives at 0.16 while they run: it waits for the first tick after their release (0.185), at 0.2.
    assert times[6] == pytest.approx((0.16, 0.04, 0.21, 0.23))


def test_dynamic_on_the_same_trace_counts_its_timeout_from_the_oldest_arrival() -> None:
    times = _simulate(Mode.DYNAMIC, TRACE)
    # The bus leaves 50 ms after its oldest passenger queued (0.03 + 0.05), not at a tick.
    assert times[0] == pytest.approx((0.03, 0.05, 0.09, 0.11))
    assert times[1] == pytest.approx((0.05, 0.03, 0.09, 0.11))
    for full in times[2:6]:
        assert full == pytest.approx((0.155, 0.0, 0.165, 0.185))
    # The late one has waited 25 ms when the batch is released at 0.185: it leaves at its timeout, 0.16 + 0.05.
    assert times[6] == pytest.approx((0.16, 0.05, 0.22, 0.24))


def test_simulated_engine_makes_the_real_engines_decisions_in_static_mode(tiny_llama: PreTrainedModel) -> None:
    engine_config = EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=16, max_model_len=128)
    config = SchedulerConfig(mode=Mode.STATIC, max_batch_size=4, batch_window_ms=30)
    reqs = with_natural_stops(tiny_llama, engine_config, config, requests(1, 14, 40, 14, 0.02))
    real = assert_same_decisions(tiny_llama, engine_config, config, reqs)
    assert any(step[5] > 0 for step in real.steps), "no seat was ever held: the case does not test the batch"
    assert len({r[3][1] for r in real.requests.values()}) > 2, "expected several batches"
    # Some batch left partial, on a tick of the 30 ms clock (the scheduler started at 0 on the virtual clock).
    on_tick = [s for s in real.steps if 0 < len(s[3]) < 4 and abs(s[0] / 0.03 - round(s[0] / 0.03)) < 1e-6]
    assert on_tick, "no partial batch left at a tick"


def test_simulate_runs_every_mode_and_a_plug_in_policy(tmp_path: Path) -> None:
    cost = write_cost(tmp_path / "cost.json")
    out = tmp_path / "sim"
    argv = ["--cost-model", str(cost), "--num-prompts", "16", "--seats", "4", "--request-rate", "inf"]
    assert simulate.main([*argv, "--mode", "all", "--policy", SPF, "--out", str(out)]) == 0
    document = json.loads((out / "result.json").read_text())
    assert list(document["runs"]) == ["static", "dynamic", "continuous", "shortest-prompt-first"]
    for name, run in document["runs"].items():
        assert run["summary"]["completed"] == 16 and run["summary"]["failed"] == 0, name
    held = {name: run["server_metrics"]["held_seats"] for name, run in document["runs"].items()}
    assert held["static"] > 0 and held["dynamic"] > 0  # mixed: short answers wait for the long ones
    assert held["continuous"] == held["shortest-prompt-first"] == 0
    assert "ShortestPromptFirst" in document["servers"]["shortest-prompt-first"]
    report = (out / "report.md").read_text()
    assert "**static/dynamic**" in report and "**shortest-prompt-first/dynamic**" in report


def test_simulate_takes_a_comma_list_in_its_order(tmp_path: Path) -> None:
    cost = write_cost(tmp_path / "cost.json")
    out = tmp_path / "sim"
    argv = ["--cost-model", str(cost), "--num-prompts", "8", "--seats", "4", "--batch-window-ms", "20"]
    assert simulate.main([*argv, "--mode", "continuous,static", "--out", str(out)]) == 0
    document = json.loads((out / "result.json").read_text())
    assert list(document["runs"]) == ["continuous", "static"]
    assert "batch_window_ms=20.0" in document["servers"]["static"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--mode", "bus"], "'bus' is neither a mode"),
        (["--mode", "static,static"], "static appear(s) twice"),
        (["--policy", "nowhere.at_all:Policy"], "cannot load the policy 'nowhere.at_all:Policy'"),
        (["--policy", "V1=" + SPF], "the policy's name 'V1'"),
    ],
)
def test_simulate_refuses_a_bad_line_up_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    cost = write_cost(tmp_path / "cost.json")
    with pytest.raises(SystemExit) as exit_info:
        simulate.main(["--cost-model", str(cost), "--num-prompts", "4", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
