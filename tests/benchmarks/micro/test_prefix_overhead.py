"""prefix-overhead on the tiny model: both settings run the same steps and fresh prompts never hit the cache."""

from __future__ import annotations

import pytest

from benchmarks.micro.prefix_overhead import measure
from tests.server_harness import tiny_loaded_model


def test_both_settings_are_measured_and_nothing_is_shared() -> None:
    row = measure(tiny_loaded_model(), batch=2, prompt_len=20, steps=18, repeats=1)  # crosses a block boundary
    assert row["batch"] == 2 and row["prompt_tokens"] == 20
    for key in ("prefill_ms_on", "prefill_ms_off", "decode_step_ms_on", "decode_step_ms_off"):
        assert row[key] > 0
    assert row["decode_throughput_on_over_off"] == pytest.approx(row["decode_step_ms_off"] / row["decode_step_ms_on"])
    assert row["minor_faults_per_attempt_on"] >= 0 and row["minor_faults_per_attempt_off"] >= 0
