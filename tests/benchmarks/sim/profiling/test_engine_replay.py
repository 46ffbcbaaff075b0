"""A served run's trace replayed through the real Scheduler on the engine alone (the load probe's reference)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from benchmarks.loadgen.trace import TraceRequest
from benchmarks.sim.profiling.engine_replay import replay_alone
from engine.outputs import StepOutput
from scheduler.config import Mode, SchedulerConfig
from tests.conftest import TINY_VOCAB_SIZE, build_tiny_causal_lm
from tests.engine.helpers import make_engine


@pytest.mark.parametrize("mode", [Mode.CONTINUOUS, Mode.DYNAMIC])
def test_replay_runs_every_request_to_its_length_and_times_the_engine(mode: Mode) -> None:
    engine = make_engine(build_tiny_causal_lm("llama"), max_rows=4)
    trace = [TraceRequest(0.0, 6, 8, 3), TraceRequest(0.0, 9, 5, None), TraceRequest(0.0, 4, 7, 7)]
    config = SchedulerConfig(mode=mode, max_batch_size=2, max_num_seqs=2, batch_timeout_ms=5.0)
    replay = replay_alone(engine, trace, config, TINY_VOCAB_SIZE)
    assert replay.generated_tokens == 3 + 5 + 7  # delivered: output_tokens where the run stopped early, else max
    # two seats: the third request waits for one; continuous refills it at once, dynamic after the first bus
    assert replay.steps == (5 + 7 if mode is Mode.DYNAMIC else 3 + 7)
    assert 0 < replay.engine_s <= replay.busy_s <= replay.span_s
    assert "step" not in vars(engine)  # the timed step no longer shadows the engine's own
    assert engine.cache_usage == 0  # every request released its cache


def test_a_replay_that_loses_requests_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed step fails its requests and the scheduler goes on; the replay must not pass off a shorter run."""
    engine = make_engine(build_tiny_causal_lm("llama"), max_rows=2)

    def broken(schedule: Sequence[tuple[int, int]]) -> StepOutput:
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine, "step", broken)
    config = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=2)
    with pytest.raises(RuntimeError, match="2 replayed requests ended failed"):
        replay_alone(engine, [TraceRequest(0.0, 6, 8, 3), TraceRequest(0.0, 9, 8, 8)], config, TINY_VOCAB_SIZE)
    assert engine.cache_usage == 0
