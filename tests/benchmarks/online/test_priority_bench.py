"""`python -m benchmarks priority`: its two-class workload, and one measurement against a real server (the tiny model)
under each setting's flags, each class summarised on its own with the priorities the server reports."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest

from api.config import ServerConfig
from benchmarks.loadgen.client import ClientConfig, build_payload
from benchmarks.online.priority_bench import BATCH, INTERACTIVE, PriorityWorkload, measure, setting_flags, table
from tests.server_harness import RunningServer, mode_config, running_server

TINY = PriorityWorkload(
    batch_requests=3,
    batch_prompt_words=6,
    batch_output_min=24,
    batch_output_max=32,
    interactive_requests=3,
    interactive_prompt_words=3,
    interactive_output=4,
    interactive_rate=math.inf,
    interactive_start_s=0.0,
)


def test_the_workload_sends_the_batch_class_first_then_the_interactive_stream() -> None:
    workload = PriorityWorkload(batch_requests=4, interactive_requests=5, interactive_start_s=2.0, seed=3)
    specs, offsets = workload.requests(send_priority=True)
    batch = [(s, o) for s, o in zip(specs, offsets, strict=True) if s.kind == BATCH]
    interactive = [(s, o) for s, o in zip(specs, offsets, strict=True) if s.kind == INTERACTIVE]
    assert len(batch) == 4 and len(interactive) == 5
    assert all(o == 0.0 and s.priority == 10 and 128 <= s.max_tokens <= 256 for s, o in batch)
    assert all(o > 2.0 and s.priority == 0 and s.max_tokens == 16 for s, o in interactive)
    assert [o for _, o in interactive] == sorted(o for _, o in interactive)
    assert len({s.index for s in specs}) == len(specs)
    assert workload.requests(send_priority=True) == (specs, offsets)  # seeded
    unprioritised, same_offsets = workload.requests(send_priority=False)
    assert same_offsets == offsets and all(s.priority == 0 for s in unprioritised)
    client = ClientConfig("http://127.0.0.1:1")
    assert build_payload(specs[0], client)["priority"] == 10
    assert "priority" not in build_payload(unprioritised[0], client)  # what an fcfs server takes


def test_bad_workload_settings_are_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="batch-requests"):
        PriorityWorkload(batch_requests=0)


def server_config(setting: str) -> ServerConfig:
    """The in-process equivalent of the server `setting` starts (its flags read as the CLI reads them)."""
    flags = setting_flags(setting, threshold=1)
    overrides: dict[str, object] = {"max_num_seqs": 2}
    if "--scheduling-policy" in flags:
        overrides["scheduling_policy"] = "priority"
    if "--priority-preemption" in flags:
        overrides["priority_preemption"] = True
    return mode_config("continuous", **overrides)


@pytest.fixture(scope="module", params=["fcfs", "priority", "preempt"])
def setting_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, RunningServer]]:
    with running_server(server_config(request.param)) as server:
        yield request.param, server


def test_each_setting_measures_both_classes_against_a_live_server(setting_server: tuple[str, RunningServer]) -> None:
    setting, server = setting_server
    specs, offsets = TINY.requests(send_priority=setting != "fcfs")
    client = ClientConfig(server.base_url, show_progress=False)
    measured = asyncio.run(measure(server.base_url, specs, offsets, client, warmup=1))
    classes = measured["classes"]
    assert classes[BATCH]["completed"] == 3 and classes[INTERACTIVE]["completed"] == 3
    assert classes[BATCH]["failed"] == 0 and classes[INTERACTIVE]["failed"] == 0
    assert classes[INTERACTIVE]["output_tokens"] == 3 * 4
    assert classes[BATCH]["ttft_ms"]["count"] == 3 and classes[INTERACTIVE]["ttft_ms"]["count"] == 3
    for record in measured["records"]:
        expected = {BATCH: 10, INTERACTIVE: 0}[record["kind"]] if setting != "fcfs" else 0
        assert record["server_timings"]["priority"] == expected
    preemptions = sum(r["server_timings"]["num_preemptions"] for r in measured["records"] if r["kind"] == BATCH)
    assert classes[BATCH]["preemptions"] == preemptions
    if setting != "preempt":
        assert preemptions == 0  # only --priority-preemption displaces a request for a seat
    rows = table({setting: measured}).splitlines()[2:]
    assert [row.split(" | ")[:2] for row in rows] == [[f"| {setting}", INTERACTIVE], [f"| {setting}", BATCH]]
