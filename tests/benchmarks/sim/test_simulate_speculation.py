"""Speculation in the simulator: the real scheduler proposes drafts (every row k, the draft-length rule picks how many
it verifies), `SimEngine` accepts them as vLLM's synthetic acceptance does, charges the verify step as the engine
runs it, and rolls the cache back by the accepted length."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from benchmarks.loadgen.trace import TraceRequest
from benchmarks.sim import cli as simulate
from benchmarks.sim.cost.model import FittedCostModel, StepShape
from benchmarks.sim.cost.speculation import accepted_drafts, decode_shape
from benchmarks.sim.engine import SimEngine, VirtualClock
from benchmarks.sim.run import SimSettings, simulate_trace
from engine.config import EngineConfig
from engine.outputs import FinishReason
from engine.sample.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from scheduler.config import Mode, SchedulerConfig
from scheduler.draft_length import Acceptance, acceptance_rates

# A CPU-like step: a fixed cost (reading the weights) and a cost per token, so a few drafts are nearly free.
CPU = FittedCostModel(
    const_s=0.010, per_token_s=0.001, per_token_over_knee_s=0.0, knee_tokens=0, per_seq_s=0.0, per_attention_mpair_s=0.0
)
BLOCK = 16


@dataclass
class Shapes:
    """A cost model that records every step's shape (and charges the CPU model)."""

    seen: list[StepShape] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "recording"

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:
        self.seen.append(shape)
        return CPU.step_time(shape)


def _engine(rate: float, caching: bool = False, seed: int = 0) -> tuple[SimEngine, Shapes]:
    shapes = Shapes()
    config = EngineConfig(max_rows=2, kv_cache_tokens=8 * BLOCK, block_size=BLOCK, enable_prefix_caching=caching)
    return SimEngine(config, shapes, VirtualClock(), acceptance_rate=rate, seed=seed), shapes


def _prefilled(engine: SimEngine, seq_id: int, prompt: int, max_tokens: int, reserve: int) -> None:
    engine.add(seq_id, list(range(100 * seq_id, 100 * seq_id + prompt)), SamplingParams(max_tokens=max_tokens))
    assert engine.reserve(seq_id, reserve)
    out = engine.step([(seq_id, prompt)])  # the prompt and the first token
    assert len(out.tokens) == 1 and engine.num_pending(seq_id) == 1


def test_all_drafts_accepted_emit_k_plus_one_tokens_and_keep_their_keys() -> None:
    engine, shapes = _engine(rate=1.0)
    _prefilled(engine, 0, prompt=10, max_tokens=50, reserve=40)
    out = engine.step([(0, 1)], {0: [0, 0, 0, 0]})
    assert len(out.tokens) == 5 and all(t.finish_reason is None for t in out.tokens)
    assert (out.num_seqs, out.num_tokens) == (1, 5)
    assert (out.drafts.num_draft_tokens, out.drafts.num_accepted_tokens, out.drafts.num_drafts) == (4, 4, 1)
    assert out.drafts.accepted_per_pos == (1, 1, 1, 1) and out.drafts.by_seq == ((0, 4, 4),)
    # 11 known tokens before; 5 emitted: 16 known, 15 computed (the bonus token is pending), as the engine's rollback.
    assert engine.num_computed(0) == 15 and engine.num_pending(0) == 1
    # Charged as the engine runs it: one sequence whose 5 positions are computed and sampled, each attending to its
    # own context (11, 12, ... 15 keys), which is read once (15 keys), as the profile's verify points are timed.
    assert shapes.seen[-1] == StepShape(1, 5, 5, 11 + 12 + 13 + 14 + 15, 15)
    assert shapes.seen[-1] == decode_shape(1, 4, 10)  # as the break-even prediction charges it
    engine.step([(0, 1)])
    assert shapes.seen[-1] == decode_shape(1, 0, 15)


def test_no_draft_accepted_emits_the_bonus_token_and_rolls_the_rest_back() -> None:
    engine, _ = _engine(rate=0.0)
    _prefilled(engine, 0, prompt=10, max_tokens=50, reserve=40)
    reserved = engine.reserved_tokens(0)
    out = engine.step([(0, 1)], {0: [0, 0, 0]})
    assert len(out.tokens) == 1 and out.drafts.by_seq == ((0, 3, 0),) and out.drafts.accepted_per_pos == (0, 0, 0)
    assert engine.num_computed(0) == 11 and engine.num_pending(0) == 1  # as a plain step leaves it
    assert engine.reserved_tokens(0) == reserved  # the drafts' blocks stay with the sequence


def test_a_finish_mid_draft_stops_the_row_there() -> None:
    engine, _ = _engine(rate=1.0)
    engine.expect_output(0, 3)  # the replayed answer stops after 3 tokens
    _prefilled(engine, 0, prompt=10, max_tokens=50, reserve=40)
    out = engine.step([(0, 1)], {0: [0, 0, 0, 0]})
    assert [t.finish_reason for t in out.tokens] == [None, FinishReason.STOP]  # tokens 2 and 3 of the answer
    assert out.drafts.by_seq == ((0, 4, 2),)  # the two emitted tokens matched their drafts


def test_drafts_must_ride_on_a_sampling_row_within_its_reserved_cache() -> None:
    engine, _ = _engine(rate=1.0)
    engine.add(0, list(range(20)), SamplingParams(max_tokens=8))
    assert engine.reserve(0, 28)
    with pytest.raises(ValueError, match="does not sample"):
        engine.step([(0, 10)], {0: [0]})  # a prompt chunk that does not end the prompt
    engine.step([(0, 20)])
    with pytest.raises(ValueError, match="reserved"):
        engine.step([(0, 1)], {0: [0] * 12})  # 21 known + 12 drafts > 32 reserved


def test_only_full_blocks_of_accepted_tokens_enter_the_prefix_cache() -> None:
    engine, _ = _engine(rate=0.0, caching=True)
    _prefilled(engine, 0, prompt=14, max_tokens=40, reserve=40)
    assert engine.blocks.registered(0) == 0  # 14 computed: no full block yet
    engine.step([(0, 1)], {0: [0] * 6})  # computes positions 14..20, accepts none
    assert engine.num_computed(0) == 15 and engine.blocks.registered(0) == 0  # rejected keys registered nothing
    engine.step([(0, 1)])
    assert engine.num_computed(0) == 16 and engine.blocks.registered(0) == 1


def _spec_run(spec: SpeculativeConfig | None, rate: float, seed: int, mode: Mode = Mode.CONTINUOUS):
    config = SchedulerConfig(mode=mode, max_batch_size=4, max_num_seqs=4, speculative=spec)
    engine = EngineConfig(max_rows=4, kv_cache_tokens=4 * 256, max_model_len=256, block_size=BLOCK)
    trace = [TraceRequest(0.01 * i, 20 + i, 40 + 7 * i, 30 + 5 * i if i % 2 else None) for i in range(6)]
    return simulate_trace(trace, SimSettings(config, engine, CPU, acceptance_rate=rate, seed=seed), "run", 1.0)


FIXED = SpeculativeConfig(4, draft_length="fixed")


@pytest.mark.parametrize("mode", list(Mode))
def test_a_speculating_run_emits_every_requests_tokens_in_fewer_steps(mode: Mode) -> None:
    off = _spec_run(None, 0.8, 0, mode)
    on = _spec_run(FIXED, 0.8, 0, mode)
    lengths = [(r.output_tokens, r.finish_reason) for r in off.records]
    assert [(r.output_tokens, r.finish_reason) for r in on.records] == lengths  # stops and max_tokens as without
    assert lengths[1] == (35, "stop") and lengths[0] == (40, "length")
    assert off.server_metrics is not None and on.server_metrics is not None
    assert off.server_metrics.draft_tokens == 0 and on.server_metrics.generation_tokens == sum(n for n, _ in lengths)
    drafted, accepted = on.server_metrics.draft_tokens, on.server_metrics.accepted_tokens
    assert drafted and accepted and 0 < accepted < drafted
    steps_on, steps_off = on.server_metrics.steps, off.server_metrics.steps
    assert steps_on is not None and steps_off is not None
    assert steps_on < steps_off
    assert on.summary.duration_s < off.summary.duration_s  # batches of 4 on this cost model: speculation pays


def test_simulated_acceptance_is_the_same_for_a_seed_and_follows_the_rate() -> None:
    first, again, other = (_spec_run(FIXED, 0.6, seed) for seed in (3, 3, 4))
    times = [r.chunk_times for r in first.records]
    assert [r.chunk_times for r in again.records] == times
    assert [r.chunk_times for r in other.records] != times
    assert first.server_metrics is not None and first.server_metrics.draft_tokens
    # Each draft right with probability R up to the first wrong one: accepted per drafted is (R + .. + R**k) / k.
    rates = []
    for rate in (0.3, 0.9):
        metrics = _spec_run(FIXED, rate, 0).server_metrics
        assert metrics is not None and metrics.draft_tokens and metrics.accepted_tokens is not None
        rates.append(metrics.accepted_tokens / metrics.draft_tokens)
    assert rates[0] == pytest.approx(sum(0.3**j for j in range(1, 5)) / 4, abs=0.06)
    assert rates[1] == pytest.approx(sum(0.9**j for j in range(1, 5)) / 4, abs=0.1)  # finishes cut some short


def test_the_rules_first_and_later_rates_both_read_the_synthetic_rate() -> None:
    """The draft-length rule values a later draft by its rate given a right one before it; under the simulator's
    independent acceptance that rate is R, as is the first draft's, so the rule's model meets the simulator's."""
    for rate in (0.3, 0.8):
        draw, counts = random.Random(5).random, Acceptance()
        for _ in range(3000):
            counts.record(4, accepted_drafts(draw, rate, 4))
        first, later = acceptance_rates([counts])
        assert (first[0], later[0]) == pytest.approx((rate, rate), abs=0.03)


def test_alone_every_accepted_draft_saves_a_step() -> None:
    config = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=1, speculative=FIXED)
    settings = SimSettings(config, EngineConfig(max_rows=1, kv_cache_tokens=512), CPU, acceptance_rate=0.7)
    on = simulate_trace([TraceRequest(0.0, 10, 200)], settings, "on", 1.0)
    plain = SimSettings(dataclasses.replace(config, speculative=None), settings.engine, CPU)
    off = simulate_trace([TraceRequest(0.0, 10, 200)], plain, "off", 1.0)
    assert on.server_metrics is not None and off.server_metrics is not None
    assert off.server_metrics.steps == 200 and on.records[0].output_tokens == 200
    assert on.server_metrics.steps == 200 - on.server_metrics.accepted_tokens


def test_the_draft_length_rule_stops_drafting_where_verifying_costs_more_than_it_saves() -> None:
    # Every token costs its full share (no fixed cost): a draft right half the time never pays, so once it has
    # measured a verify step (the prompt's, with 4 drafts) and a plain one the rule leaves the row at 0, bar a
    # one-draft probe every 32nd step.
    linear = FittedCostModel(0.0, 0.001, 0.0, 0, 0.0, 0.0)
    config = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=1, speculative=SpeculativeConfig(4))
    settings = SimSettings(config, EngineConfig(max_rows=1, kv_cache_tokens=512), linear, acceptance_rate=0.5)
    metrics = simulate_trace([TraceRequest(0.0, 10, 200)], settings, "auto", 1.0).server_metrics
    assert metrics is not None and metrics.draft_tokens is not None
    assert metrics.draft_tokens == 4 + 200 // 32


def test_simulate_cli_runs_each_mode_with_and_without_speculation(tmp_path: Path) -> None:
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"model": {f: getattr(CPU, f) for f in CPU.__dataclass_fields__}}))
    out = tmp_path / "sim"
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    argv = ["--cost-model", str(cost), "--num-prompts", "12", "--seats", "4", "--mode", "continuous"]
    assert simulate.main([*argv, "--speculative-config", spec, "--speculation", "both", "--out", str(out)]) == 0
    document = json.loads((out / "result.json").read_text())
    assert set(document["runs"]) == {"continuous", "continuous-spec"}
    assert document["settings"]["speculative_config"] == spec and document["settings"]["acceptance_rate"] == 0.5
    assert document["runs"]["continuous-spec"]["server_metrics"]["draft_tokens"] > 0
    assert document["runs"]["continuous"]["server_metrics"]["draft_tokens"] == 0
    for bad in (
        ["--speculative-config", '{"num_speculative_tokens": 0}'],
        ["--speculation", "both"],
        ["--speculative-config", spec, "--acceptance-rate", "1.5"],
    ):
        with pytest.raises(SystemExit):
            simulate.main([*argv, *bad])
