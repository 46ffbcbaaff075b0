"""prefix-overhead on the tiny model: one engine runs all three settings, only "on" looks prompts up, and fresh
prompts never hit the cache."""

from __future__ import annotations

import pytest

from benchmarks.micro.prefix_overhead import CYCLE, SETTINGS, measure
from tests.server_harness import tiny_loaded_model


def test_each_setting_is_measured_and_only_on_looks_up() -> None:
    batch, prompt_len = 2, 20
    row = measure(tiny_loaded_model(), batch=batch, prompt_len=prompt_len, steps=18, repeats=1)  # crosses a block
    assert row["batch"] == batch and row["prompt_tokens"] == prompt_len
    for setting in SETTINGS:
        assert row[f"prefill_ms_{setting}"] > 0 and row[f"decode_step_ms_{setting}"] > 0
        assert row[f"minor_faults_per_attempt_{setting}"] >= 0
    assert row["decode_throughput_on_over_off"] == pytest.approx(row["decode_step_ms_off"] / row["decode_step_ms_on"])
    assert row["decode_throughput_control_over_off"] == pytest.approx(
        row["decode_step_ms_off"] / row["decode_step_ms_control"]
    )
    # Two warm-up cycles and one measured attempt of each setting: only the "on" attempts looked their prompts up.
    on_attempts = 2 * CYCLE.count("on") + 1
    assert row["tokens_looked_up"] == on_attempts * batch * prompt_len
