"""`python -m benchmarks kernel-ab`: another commit's kernels compiled beside the working tree's and timed in turn."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.micro import kernel_ab
from engine.platform import native
from engine.platform.cpu_features import cpu_features


def test_a_revision_s_sources_are_its_own_csrc(tmp_path: Path) -> None:
    commit = kernel_ab.revision_sources("HEAD", tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=kernel_ab.REPOSITORY, capture_output=True, text=True)
    assert commit == head.stdout.strip()
    written = sorted(path.name for path in (tmp_path / "engine" / "csrc").iterdir())
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", "HEAD", "engine/csrc/"],
        cwd=kernel_ab.REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert written == sorted(Path(name).name for name in listed) and "int4_dot.cpp" in written


def test_an_unknown_revision_is_refused(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        kernel_ab.revision_sources("no-such-revision", tmp_path)


def test_the_ratio_is_the_median_of_each_round_s_pair() -> None:
    # Round 2 is slow for both sides (drift); the pairs' ratios are 0.5, 0.5 and 2.0.
    got = kernel_ab.summary(before=[10.0, 40.0, 10.0], after=[5.0, 20.0, 20.0])
    assert got == {"before_best_us": 10.0, "after_best_us": 5.0, "after_over_before": 0.5}


@pytest.mark.slow
@pytest.mark.parametrize("op", kernel_ab.OPS)
def test_head_against_itself_gives_the_same_bits(tmp_path: Path, op: str) -> None:
    """HEAD's kernels compiled under their own namespace beside the working tree's: where the sources agree (a clean
    checkout) every output is bit for bit the same (int6_dot against int8_dot on its values requantised: close); the
    command writes its result either way. A Q6_K head is the 1B's (SmolLM2's has no 256-input super-blocks)."""
    if not any(build.name == "avx2" for build in native.builds_for(cpu_features())):
        pytest.skip("needs a CPU that runs the avx2 build")
    clean = not subprocess.run(
        ["git", "status", "--porcelain", "engine/csrc"], cwd=kernel_ab.REPOSITORY, capture_output=True, text=True
    ).stdout.strip()
    shapes = "llama-3.2-1b" if op.startswith("int6_dot") else "smollm2"
    argv = [
        "--against",
        "HEAD",
        "--build",
        "avx2",
        "--op",
        op,
        "--shapes",
        shapes,
        "--rows",
        "1,3",
        "--rounds",
        "2",
        "--inner",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert kernel_ab.main(argv) == 0
    document = json.loads((tmp_path / "result.json").read_text())
    assert document["build"] == "avx2" and document["op"] == op and len(document["against"]) == 40
    assert len(document["results"]) == 2 * len(kernel_ab.shapes_for(op, shapes))
    for row in document["results"]:
        assert row["before_best_us"] > 0 and row["after_best_us"] > 0 and row["after_over_before"] > 0
        if op.startswith("int6_dot"):  # int8 per row of Q6_K's values: a rounding apart, never equal
            assert 0.0 < row["max_relative_difference"] < 0.05
        elif clean:
            assert row["max_relative_difference"] == 0.0


def test_a_q6_k_head_is_refused_on_a_model_without_one(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        kernel_ab.main(["--op", "int6_dot", "--shapes", "smollm2", "--out", str(tmp_path)])


def test_streamed_copies_hold_the_requested_bytes_and_keep_shared_tensors_shared() -> None:
    """`--stream-mb`: enough clones that the set outgrows the cache; a tensor both sides take (the packed weights
    under `--symmetric`) is one tensor in each clone, and each clone's tensors are new memory."""
    packed, before_zeros = torch.ones(250_000, dtype=torch.uint8), torch.zeros(250_000, dtype=torch.uint8)
    operands = ((packed, 32, before_zeros), (packed, 32, torch.empty(0, dtype=torch.uint8)))
    copies = kernel_ab._copies_of(operands, stream_mb=2.0)  # 0.5 MB a copy
    assert len(copies) == 4 and copies[0] is operands
    for before, after in copies[1:]:
        assert before[0] is after[0] and before[0].data_ptr() != packed.data_ptr()
        assert before[1] == 32 and torch.equal(before[0], packed) and torch.equal(before[2], before_zeros)
    assert len(kernel_ab._copies_of(operands, stream_mb=0.0)) == 1


def test_int6_before_runs_int6_dot_on_both_sides() -> None:
    """`--int6-before`: both sides call int6_dot on the same Q6_K operands (a change to that kernel); without it the
    before side is int8_dot on the values requantised per row."""
    kernels = next(
        (k for k in map(native.load_kernels, native.builds_for(cpu_features())) if k and k.has_int6_dot), None
    )
    if kernels is None:
        pytest.skip("no build with int6_dot here")
    generator = torch.Generator().manual_seed(0)
    (before, after), (before_args, after_args) = kernel_ab._operands(
        "int6_dot", 512, 64, generator, kernels, int6_before=True
    )
    assert before == after == "int6_dot" and before_args is after_args
    (before, after), (before_args, after_args) = kernel_ab._operands("int6_dot", 512, 64, generator, kernels)
    assert (before, after) == ("int8_dot", "int6_dot") and len(before_args) == len(after_args) == 4
    assert before_args[0].shape != after_args[0].shape  # int8's packing holds a byte a weight, int6's less
