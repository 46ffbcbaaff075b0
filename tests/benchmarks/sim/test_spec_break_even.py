"""The simulator's model of speculation: vLLM's synthetic acceptance and the predicted break-even batch size."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.sim.cost.model import FittedCostModel
from benchmarks.sim.spec_break_even import break_even, expected_emitted, main, sample_emitted, speedups

# A CPU-like step: a large fixed cost (reading the weights) and a per-token cost, so a few rows are nearly free.
CPU = FittedCostModel(
    const_s=0.010, per_token_s=0.001, per_token_over_knee_s=0.0, knee_tokens=0, per_seq_s=0.0, per_attention_mpair_s=0.0
)


def test_sampled_acceptance_stops_at_the_first_rejection_and_matches_its_mean() -> None:
    rng = np.random.default_rng(0)
    emitted = sample_emitted(rng, 0.6, 4, 200_000)
    assert emitted.min() == 1 and emitted.max() == 5
    assert emitted.mean() == pytest.approx(expected_emitted(0.6, 4), rel=0.01)
    # P(exactly j accepted) = R**j (1 - R) for j < k: the first rejection ends the row's drafts.
    assert np.mean(emitted == 2) == pytest.approx(0.6 * 0.4, abs=0.005)
    assert np.mean(emitted == 5) == pytest.approx(0.6**4, abs=0.005)
    assert (sample_emitted(rng, 0.0, 4, 100) == 1).all() and (sample_emitted(rng, 1.0, 3, 100) == 4).all()


def test_break_even_is_where_verifying_costs_more_than_it_emits() -> None:
    # k=4, R=0.5: 1.9375 tokens per row per step; plain b rows cost 10+b ms, speculative 10+5b ms.
    # 1.9375 (10+b) <= 10+5b once b >= 9.375/3.0625 = 3.06: batch 4.
    batches = [1, 2, 3, 4, 8, 32]
    assert break_even(CPU, 0.5, 4, 0, batches) == 4
    ratios = speedups(CPU, 0.5, 4, 0, batches)
    assert ratios[0] > 1.0 and (np.diff(ratios) < 0).all()
    assert break_even(CPU, 0.5, 4, 0, [1, 2, 3]) is None
    # Better acceptance pays at larger batches.
    better = break_even(CPU, 0.9, 4, 0, list(range(1, 65)))
    assert better is not None and better > 4


def test_command_prints_the_break_even_batch(tmp_path, capsys) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"model": {f: getattr(CPU, f) for f in CPU.__dataclass_fields__}}))
    main(["--cost-model", str(path), "--acceptance-rate", "0.5", "--k", "4", "--context", "0", "--batches", "1,4,2,3"])
    out = json.loads(capsys.readouterr().out)
    assert out["break_even_batch"] == 4 and [r["batch"] for r in out["by_batch"]] == [1, 2, 3, 4]
    with pytest.raises(SystemExit):
        main(["--cost-model", str(path), "--acceptance-rate", "1.5"])
