"""The simulator's prefix cache on the virtual clock: what a trace's prefix identity shares, what it saves, and what
a small KV cache evicts, each to the exact step time the cost model charges."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.loadgen.arrivals import ArrivalConfig
from benchmarks.loadgen.trace import TraceRequest, read_trace, synthesize, write_trace
from benchmarks.loadgen.workloads import WorkloadConfig
from benchmarks.sim import cli as simulate
from benchmarks.sim.cost.files import save_fitted
from benchmarks.sim.cost.model import FittedCostModel, StepShape, chunk_attention_pairs, fit_cost_model
from benchmarks.sim.run import SimSettings, simulate_trace
from engine.config import EngineConfig
from scheduler.config import Mode, SchedulerConfig

COST = FittedCostModel(
    const_s=0.004, per_token_s=0.0005, per_token_over_knee_s=0.002, knee_tokens=8, per_seq_s=0.001,
    per_attention_mpair_s=50.0,
)  # fmt: skip


def prefill_s(computed: int, count: int) -> float:
    """One lone sequence's step computing `count` tokens after `computed` ones, and sampling its first token."""
    return COST.step_time(StepShape(1, count, 1, chunk_attention_pairs(computed, count), computed + count))


def settings(mode: Mode, caching: bool, kv_cache_tokens: int = 1024, seats: int = 1, max_len: int = 128) -> SimSettings:
    scheduler = SchedulerConfig(mode=mode, max_batch_size=seats, max_num_seqs=seats, batch_timeout_ms=0)
    engine = EngineConfig(
        max_rows=seats,
        kv_cache_tokens=kv_cache_tokens,
        block_size=16,
        max_model_len=max_len,
        enable_prefix_caching=caching,
    )
    return SimSettings(scheduler, engine, COST)


@pytest.mark.parametrize("mode", [Mode.DYNAMIC, Mode.CONTINUOUS])
def test_a_conversations_next_turn_computes_only_what_is_not_cached(mode: Mode) -> None:
    # Turn one: 40 prompt tokens, 9 answered; 48 of them computed (the last answer token never is), so three full
    # blocks are registered. Turn two re-sends all 49 and 10 new tokens: 59, of which (59 - 1) // 16 = 3 blocks are
    # read and 11 tokens computed.
    trace = [TraceRequest(0.0, 40, 9), TraceRequest(0.0, 59, 4, follows=0)]
    on = simulate_trace(trace, settings(mode, True), "on", 1.0).records
    off = simulate_trace(trace, settings(mode, False), "off", 1.0).records
    for records in (on, off):
        assert records[1].send_time == records[0].end_time  # sent when the previous turn ended
        assert [r.prompt_tokens for r in records] == [40, 59]
        assert [r.kind for r in records] == ["first-turn", "later-turn"]
        assert records[0].ttft == pytest.approx(prefill_s(0, 40))
    assert [r.server_timings["cached_tokens"] for r in on if r.server_timings] == [0, 48]
    assert [r.server_timings["cached_tokens"] for r in off if r.server_timings] == [0, 0]
    assert on[1].ttft == pytest.approx(prefill_s(48, 11))
    assert off[1].ttft == pytest.approx(prefill_s(0, 59))
    assert on[1].ttft < off[1].ttft / 2


def test_with_no_shared_prefix_caching_on_and_off_run_identically() -> None:
    """Every prompt its own: the cache registers blocks but never finds one, and parked blocks count as free, so
    nothing a scheduler sees differs."""
    workload = WorkloadConfig(name="mixed", num_prompts=40, seed=3)
    trace = synthesize(workload, ArrivalConfig(request_rate=30.0, seed=3))
    assert all(r.prefix_id is None and r.follows is None for r in trace)
    for mode in (Mode.DYNAMIC, Mode.CONTINUOUS):
        on, off = (simulate_trace(trace, settings(mode, c, 2048, seats=4, max_len=512), "x", 30.0) for c in (1, 0))
        assert on.records == off.records  # every time, token count and server timing
        assert on.server_metrics == off.server_metrics
        assert on.summary.completed == 40 and on.server_metrics is not None and on.server_metrics.steps > 40


def test_a_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    """The same trace with a cache too small for four long answers: continuous mode preempts, and with caching on
    a resumed request reads back what of its own blocks is still cached instead of recomputing all of it."""
    workload = WorkloadConfig(name="mixed", num_prompts=40, seed=3)
    trace = synthesize(workload, ArrivalConfig(request_rate=30.0, seed=3))
    on, off = (simulate_trace(trace, settings(Mode.CONTINUOUS, c, 768, 4, 512), "x", 30.0) for c in (1, 0))
    assert all(r.server_timings and r.server_timings["cached_tokens"] == 0 for r in on.records)  # nothing shared
    preemptions = [r.server_timings["num_preemptions"] for r in on.records if r.server_timings]
    assert sum(preemptions) > 0
    assert preemptions == [r.server_timings["num_preemptions"] for r in off.records if r.server_timings]
    assert on.server_metrics is not None and off.server_metrics is not None
    assert on.server_metrics.prompt_tokens < off.server_metrics.prompt_tokens  # fewer tokens recomputed
    assert on.summary.duration_s < off.summary.duration_s


def test_a_small_kv_cache_evicts_the_least_recently_released_prefix_only_when_blocks_run_out() -> None:
    # One seat, eight 16-token blocks; each request arrives once the one before has ended. Requests 0 and 1 leave
    # two full blocks each of prefixes "a" and "b" parked (their third block, part-filled, goes back free). Request
    # 2 needs six blocks: the four free ones, then it evicts the two least recently released, those of "a". Request
    # 3 still finds "b" (the one free block is enough beside it); request 4 finds "a" gone. With sixteen blocks
    # nothing is evicted.
    trace = [
        TraceRequest(0.0, 33, 1, prefix_id="a", prefix_tokens=32),
        TraceRequest(1.0, 33, 1, prefix_id="b", prefix_tokens=32),
        TraceRequest(2.0, 80, 1),
        TraceRequest(3.0, 33, 1, prefix_id="b", prefix_tokens=32),
        TraceRequest(4.0, 33, 1, prefix_id="a", prefix_tokens=32),
    ]
    small = simulate_trace(trace, settings(Mode.CONTINUOUS, True, kv_cache_tokens=128), "small", 1.0).records
    large = simulate_trace(trace, settings(Mode.CONTINUOUS, True, kv_cache_tokens=256), "large", 1.0).records
    assert [r.server_timings["cached_tokens"] for r in small if r.server_timings] == [0, 0, 0, 32, 0]
    assert [r.server_timings["cached_tokens"] for r in large if r.server_timings] == [0, 0, 0, 32, 32]
    assert small[3].ttft == pytest.approx(prefill_s(32, 1))
    assert small[4].ttft == pytest.approx(prefill_s(0, 33))
    assert large[4].ttft == pytest.approx(prefill_s(32, 1))


def test_requests_sharing_a_named_prefix_share_its_blocks_and_nothing_else() -> None:
    # Prefix "p" of 40 tokens: the second request reads its two full blocks; a third naming "q" reads none.
    trace = [
        TraceRequest(0.0, 50, 2, prefix_id="p", prefix_tokens=40),
        TraceRequest(1.0, 45, 2, prefix_id="p", prefix_tokens=40),
        TraceRequest(2.0, 50, 2, prefix_id="q", prefix_tokens=40),
    ]
    records = simulate_trace(trace, settings(Mode.CONTINUOUS, True), "c", 1.0).records
    assert [r.server_timings["cached_tokens"] for r in records if r.server_timings] == [0, 32, 0]
    assert records[1].ttft == pytest.approx(prefill_s(32, 13))


def test_trace_prefix_fields_round_trip_and_follows_is_renumbered_by_arrival(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        {"arrival_s": 0.5, "prompt_tokens": 40, "max_tokens": 9},
        {"arrival_s": 0.0, "prompt_tokens": 70, "max_tokens": 4, "prefix_id": "doc", "prefix_tokens": 64},
        {"arrival_s": 0.5, "prompt_tokens": 59, "max_tokens": 4, "follows": 0},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = read_trace(path)
    assert trace == [
        TraceRequest(0.0, 70, 4, prefix_id="doc", prefix_tokens=64),
        TraceRequest(0.5, 40, 9),
        TraceRequest(0.5, 59, 4, follows=1),  # the file's request 0 is now the second
    ]
    assert read_trace(write_trace(trace, tmp_path / "again.jsonl")) == trace
    bad = {
        "prefix_tokens": '{"arrival_s": 0, "prompt_tokens": 8, "max_tokens": 1, "prefix_id": "x", "prefix_tokens": 9}',
        "prefix_id": '{"arrival_s": 0, "prompt_tokens": 8, "max_tokens": 1, "prefix_id": 7, "prefix_tokens": 4}',
        "earlier": '{"arrival_s": 0, "prompt_tokens": 8, "max_tokens": 1, "follows": 0}',
    }
    for field, line in bad.items():
        (tmp_path / "bad.jsonl").write_text(line + "\n")
        with pytest.raises(ValueError, match=rf"bad\.jsonl:1: .*{field}"):
            read_trace(tmp_path / "bad.jsonl")
    (tmp_path / "late.jsonl").write_text(json.dumps(lines[0]) + "\n" + json.dumps({**lines[2], "arrival_s": 0.1}))
    with pytest.raises(ValueError, match="arrives after it"):
        read_trace(tmp_path / "late.jsonl")


def test_synthesized_multi_turn_and_shared_prefix_traces_carry_their_prefixes() -> None:
    turns = synthesize(
        WorkloadConfig(name="multi-turn", num_prompts=6, turns=3, system_prompt_words=64), ArrivalConfig()
    )
    assert [(r.prefix_id, r.prefix_tokens, r.follows) for r in turns] == [
        ("system", 64, None), (None, 0, 0), (None, 0, 1), ("system", 64, None), (None, 0, 3), (None, 0, 4),
    ]  # fmt: skip
    shared = synthesize(WorkloadConfig(name="shared-prefix", num_prompts=4, prefix_groups=2), ArrivalConfig())
    assert [(r.prefix_id, r.prefix_tokens) for r in shared] == [("group 0", 512), ("group 1", 512)] * 2


def test_simulate_runs_each_mode_with_caching_on_and_off(tmp_path: Path) -> None:
    """`--prefix-caching both`, as `ab`'s: every mode also runs as <mode>-nocache, and the report's ratios compare
    them; a conversation's later turns wait less with the cache."""
    cost = tmp_path / "cost.json"
    shapes = [StepShape(n, n * t, n, n * t * t, n * t) for n in (1, 2, 4) for t in (1, 16, 64)]
    save_fitted(fit_cost_model(shapes, [COST.step_time(s) for s in shapes], "test"), cost, {})
    out = tmp_path / "sim"
    argv = ["--cost-model", str(cost), "--workload", "multi-turn", "--num-prompts", "12", "--turns", "3"]
    argv += ["--system-prompt-words", "96", "--seats", "4", "--prefix-caching", "both", "--out", str(out)]
    assert simulate.main(argv) == 0
    document = json.loads((out / "result.json").read_text())
    assert list(document["runs"]) == ["dynamic", "continuous", "dynamic-nocache", "continuous-nocache"]
    assert document["settings"]["prefix_caching"] == "both"
    for mode in ("dynamic", "continuous"):
        ratios = document["prefix_caching_ratios"][mode]
        assert ratios["ttft_p50_off_over_on[later-turn]"] > 1.5, ratios
    assert "## Prefix caching on against off" in (out / "report.md").read_text()
    off = tmp_path / "off"
    assert simulate.main([*argv[:-4], "--prefix-caching", "off", "--mode", "continuous", "--out", str(off)]) == 0
    assert list(json.loads((off / "result.json").read_text())["runs"]) == ["continuous"]


def test_a_next_turn_of_a_refused_request_is_still_sent() -> None:
    # A queue of one: the second conversation's first turn is refused (429); its next turn goes out as soon as its
    # own arrival time allows (the refusal ended the first turn at once), with no answer in its history.
    trace = [TraceRequest(0.0, 20, 30), TraceRequest(0.0, 20, 4), TraceRequest(0.5, 30, 4, follows=1)]
    base = settings(Mode.CONTINUOUS, True)
    refusing = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, max_queue=1))
    records = simulate_trace(trace, refusing, "c", 1.0).records
    assert records[1].error is not None and records[1].error.startswith("HTTP 429")
    assert records[2].ok and records[2].send_time == 0.5 and records[2].prompt_tokens == 30
