"""The quality benchmark (`benchmarks.micro.quality`) on the tiny model: perplexity through prompt logprobs, greedy
agreement against float32, and the top-two margin where a setting first departs from it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.micro.quality import Divergence, Setting, compare, perplexity, rms_change, run

TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 6


def test_setting_parses_dtype_and_quantization() -> None:
    assert Setting.parse("bfloat16/int4") == Setting("bfloat16", "int4")
    with pytest.raises(Exception, match="DTYPE/QUANTIZATION"):
        Setting.parse("bfloat16")


def test_the_rms_change_is_token_by_token_where_perplexity_nets_out() -> None:
    baseline = [-1.0, -2.0, -3.0, -4.0]
    shifted = [-0.5, -2.5, -2.5, -4.5]  # the same sum: the same perplexity, every token moved by 0.5
    assert perplexity(shifted) == pytest.approx(perplexity(baseline))
    assert rms_change(shifted, baseline) == pytest.approx(0.5) and rms_change(baseline, baseline) == 0.0


def test_compare_finds_the_first_difference_and_its_float32_margin() -> None:
    result = compare([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]], [[0.5, 0.4, 0.3], [2.0, 0.01, 1.0]])
    assert result == [Divergence(0, None, None), Divergence(1, 1, 0.01)]


def test_float32_baseline_is_itself_and_bfloat16_is_measured_against_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(TEXT)
    report = run(str(tiny_checkpoint), [Setting("bfloat16", "none")], tmp_path, prompts=4, max_tokens=8, chunk=32)
    baseline, bf16 = report["results"]
    assert baseline["setting"] == "float32/none" and bf16["setting"] == "bfloat16/none"
    assert baseline["perplexity_ratio"] == 1.0 and baseline["identical_prompts"] == 4
    assert baseline["logprob_rms"] == 0.0 and bf16["logprob_rms"] > 0.0
    assert baseline["scored_tokens"] == bf16["scored_tokens"] > 32  # every chunk's positions but its first
    assert math.isfinite(bf16["perplexity"]) and bf16["perplexity"] > 1.0
    assert len(bf16["divergences"]) == 4
    for divergence in bf16["divergences"]:
        if divergence["first_difference"] is not None:
            assert 0 <= divergence["first_difference"] < 8 and divergence["top2_gap"] >= 0
