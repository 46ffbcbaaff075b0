"""prefix-overhead: one engine runs all three settings, only "on" looks prompts up, fresh prompts never hit the
cache, and a cycle's paired ratio cancels a steady drift."""

from __future__ import annotations

import pytest

from benchmarks.micro.prefix_overhead import CYCLE, SETTINGS, _paired_ratio, measure
from tests.server_harness import tiny_loaded_model


def test_each_setting_is_measured_and_only_on_looks_up() -> None:
    batch, prompt_len = 2, 20
    row = measure(tiny_loaded_model(), batch=batch, prompt_len=prompt_len, steps=18, cycles=2)  # crosses a block
    assert row["batch"] == batch and row["prompt_tokens"] == prompt_len
    for setting in SETTINGS:
        assert row[f"prefill_ms_{setting}"] > 0 and row[f"decode_step_ms_{setting}"] > 0
        assert row[f"minor_faults_per_attempt_{setting}"] >= 0
    for setting in ("on", "control"):
        assert row[f"prefill_throughput_{setting}_over_off"] > 0 and row[f"decode_throughput_{setting}_over_off"] > 0
    # Two warm-up cycles and two measured ones: only the "on" attempts looked their prompts up.
    assert row["tokens_looked_up"] == 4 * CYCLE.count("on") * batch * prompt_len


def test_a_steady_drift_cancels_in_the_paired_ratio() -> None:
    """Every attempt takes 1 ms longer than the one before; "on" costs 10 % more. The plain medians would mix the
    drift in, the paired ratio gives exactly 1 / 1.1 (and 1.0 for the control)."""
    cost = {"on": 1.1, "off": 1.0, "control": 1.0}
    samples: dict[str, list[tuple[float, float]]] = {setting: [] for setting in SETTINGS}
    for attempt in range(3 * len(CYCLE)):
        setting = CYCLE[attempt % len(CYCLE)]
        seconds = cost[setting] * (1.0 + 0.001 * attempt)
        samples[setting].append((seconds, seconds))
    assert _paired_ratio(samples, "on", 1) == pytest.approx(1 / 1.1, rel=1e-3)
    assert _paired_ratio(samples, "control", 0) == pytest.approx(1.0, rel=1e-3)
