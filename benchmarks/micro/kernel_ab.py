"""A kernel change measured against the sources of another commit, in one process: `int4_dot` (or `--op
int4_gemm`, the one-digit kernel of large steps) on SmolLM2-135M's projection shapes (or `--shapes llama-3.2-1b`),
or the int8 LM head's `int8_dot` (two digits, or `int8_dot_one_digit` as large steps run it) on its shape,
the working tree's build and the other commit's build of the same instruction set called in turn, round by round,
so the VM's drift (up to 3x within an hour on these machines) moves both alike. `--op int6_dot` (or
`int6_dot_one_digit`) times a Q6_K head on the working tree's `int6_dot` against the other commit's `int8_dot` on the
same values requantised per row: the head a GGUF's Q6_K runs on now against the int8 one it ran on before;
`--int6-before` runs the other commit's `int6_dot` instead, for a change to that kernel.

    python -m benchmarks kernel-ab --against HEAD~1 [--build avx2] [--op int4_gemm] [--rows 1,4,16,32] --out DIR

The other commit's `engine/csrc/` is taken with `git archive` and compiled once into the extension cache under its
own op namespace, with the flags of `--build` (default: the best build this CPU executes). Reported per shape and
row count: each side's best time, the median over rounds of the round's after / before ratio, and the largest
difference between the two outputs relative to the output's largest value. Writes DIR/result.json.

`--stream-mb M` cycles each side through copies of the weights that together hold at least M MB, so every call
reads its weights from memory as a decode step over a model's layers does; with the default (one copy) a shape
small enough stays in the last-level cache and only the arithmetic is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import itertools
import math
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.results_io.report import write_json
from benchmarks.scripts.int4_gemm_bench import random_int4
from engine.model.head_linear import ONE_DIGIT_GROUP, Int6DotLinear, Int8DotLinear
from engine.model.linear import Int4DotLinear
from engine.platform import native
from engine.platform.cpu_features import cpu_features
from engine.weights.quantization import Int6Weight, Int8Weight, int8_from_dense

REPOSITORY = Path(__file__).resolve().parents[2]
# [inputs, outputs] of each model's int4 projections: fused q/k/v, attention output, fused gate/up, down.
SHAPES = {
    "smollm2": ((576, 960), (576, 576), (576, 3072), (1536, 576)),
    "llama-3.2-1b": ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)),
    "llama-3.2-3b": ((3072, 5120), (3072, 3072), (3072, 16384), (8192, 3072)),
}
# [inputs, outputs] of each model's LM head (int8 weights).
HEADS = {"smollm2": (576, 49152), "llama-3.2-1b": (2048, 128256), "llama-3.2-3b": (3072, 128256)}
OPS = ("int4_dot", "int4_gemm", "int8_dot", "int8_dot_one_digit", "int6_dot", "int6_dot_one_digit")


def shapes_for(op: str, model: str) -> tuple[tuple[int, int], ...]:
    """The [inputs, outputs] shapes `op` is timed on for `model`: its LM head for int8_dot and int6_dot, else its
    projections. A Q6_K head needs whole 256-input super-blocks: SmolLM2's (576 inputs, and Q8_0 in its file) has
    none to time."""
    if op.startswith("int6_dot") and HEADS[model][0] % 256:
        raise ValueError(f"{op} times a Q6_K head, which {model}'s is not (its inputs are not a multiple of 256)")
    return (HEADS[model],) if op.startswith(("int8_dot", "int6_dot")) else SHAPES[model]


def revision_sources(revision: str, into: Path) -> str:
    """`revision`'s engine/csrc/ written under `into`; returns the commit it names."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{revision}^{{commit}}"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "engine/csrc"], cwd=REPOSITORY, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit


def compile_revision(sources: Path, build: native.KernelBuild, commit: str) -> Any:
    """The ops of `sources` (a revision's engine/csrc) compiled with `build`'s flags under a namespace of their own."""
    from torch.utils import cpp_extension

    namespace = f"batchserve_ab_{commit[:12]}_{build.name}"
    texts = "".join(path.read_text() for path in sorted(sources.iterdir()))
    key = hashlib.sha256(f"{texts}{build.flags}{torch.__version__}".encode()).hexdigest()[:12]
    cpp_extension.load(
        name=f"{namespace}_{key}",
        sources=[str(path) for path in sorted(sources.glob("*.cpp"))],
        extra_cflags=native.compile_flags(build, namespace),
        extra_ldflags=list(native.LINK_FLAGS),
        is_python_module=False,
    )
    return getattr(torch.ops, namespace)


def interleaved(calls: Mapping[str, Callable[[], object]], rounds: int, inner: int) -> dict[str, list[float]]:
    """Each call's time per call in microseconds, `rounds` samples of `inner` calls, the calls taken in turn, in
    reverse order every other round: taken in one order, the second of the same kernel measured 0.87-0.92x the
    first's time (int4_dot streamed at one row), a bias that would pass for a change."""
    for call in calls.values():
        for _ in range(3):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(rounds):
        order = list(calls.items())
        for name, call in order if round_index % 2 == 0 else reversed(order):
            started = time.perf_counter()
            for _ in range(inner):
                call()
            samples[name].append((time.perf_counter() - started) / inner * 1e6)
    return samples


def summary(before: Sequence[float], after: Sequence[float]) -> dict[str, float]:
    """Best times and the median of the rounds' after / before ratios (each round's pair ran back to back)."""
    return {
        "before_best_us": round(min(before), 1),
        "after_best_us": round(min(after), 1),
        "after_over_before": round(statistics.median(a / b for a, b in zip(after, before, strict=True)), 3),
    }


@torch.inference_mode()
def compare(
    before_ops: Any,
    after_ops: Any,
    rows: Sequence[int],
    dtype: torch.dtype,
    rounds: int,
    inner: int,
    kernels: native.Kernels,
    op: str = "int4_dot",
    shapes: Sequence[tuple[int, int]] = SHAPES["smollm2"],
    stream_mb: float = 0.0,
    symmetric: bool = False,
    int6_before: bool = False,
) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    results = []
    for inputs, outputs in shapes:
        (before_name, after_name), operands = _operands(op, inputs, outputs, generator, kernels, symmetric, int6_before)
        copies = _copies_of(operands, stream_mb)
        for count in rows:
            x = torch.randn(count, inputs, generator=generator).to(dtype)
            before_args, after_args = operands
            old, new = (
                getattr(before_ops, before_name)(x, *before_args).float(),
                getattr(after_ops, after_name)(x, *after_args).float(),
            )
            turn = itertools.cycle(copies)
            calls = {
                "before": _cycling(getattr(before_ops, before_name), x, turn, 0),
                "after": _cycling(getattr(after_ops, after_name), x, turn, 1),
            }
            samples = interleaved(calls, rounds, inner)
            difference = float((new - old).abs().max() / old.abs().max().clamp_min(1e-30))
            row = {
                "inputs": inputs,
                "outputs": outputs,
                "rows": count,
                "weight_copies": len(copies),
                **summary(samples["before"], samples["after"]),
                "max_relative_difference": difference,
            }
            print(row, flush=True)
            results.append(row)
    return results


Arguments = tuple[Any, ...]
SideArguments = tuple[Arguments, Arguments]  # before's operands after x, after's


def _copies_of(operands: SideArguments, stream_mb: float) -> list[SideArguments]:
    """`operands` and as many clones of their tensors as it takes to hold `stream_mb` MB between them (at least one
    copy): calls that take them in turn read each from memory once the set outgrows the last-level cache. A tensor
    both sides take stays shared in each clone."""
    tensors = {id(t): t for side in operands for t in side if isinstance(t, torch.Tensor)}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    copies = [operands]
    for _ in range(max(1, math.ceil(stream_mb * 1e6 / size)) - 1):
        clones = {key: t.clone() for key, t in tensors.items()}
        before, after = (tuple(clones.get(id(a), a) for a in side) for side in operands)
        copies.append((before, after))
    return copies


def _cycling(
    kernel: Callable[..., object], x: torch.Tensor, turn: Iterator[SideArguments], side: int
) -> Callable[[], object]:
    """A call of `kernel` on x and `side`'s operands of the next copy from `turn`, which both sides share: neither
    side reads the copies the other has just brought into the cache."""
    return lambda: kernel(x, *next(turn)[side])


def _operands(
    op: str,
    inputs: int,
    outputs: int,
    generator: torch.Generator,
    kernels: native.Kernels,
    symmetric: bool = False,
    int6_before: bool = False,
) -> tuple[tuple[str, str], SideArguments]:
    """The kernels before and after call for `op`, and each side's operands after x, on random weights of [outputs,
    inputs]. `symmetric`: int4 weights whose zeros are all 0 (GGUF Q4_0's), as the working tree builds them for after
    and with their zeros stored for before (which every earlier commit's kernels take)."""
    if op.startswith("int6_dot"):
        codes = torch.randint(0, 64, (outputs, inputs), dtype=torch.uint8, generator=generator)
        subs = torch.randint(-128, 128, (outputs, inputs // 16), dtype=torch.int8, generator=generator)
        weight = Int6Weight(codes, subs, torch.rand(outputs, inputs // 256, generator=generator) * 1e-4)
        six = Int6DotLinear.build(weight, None, kernels)
        one_digit = op == "int6_dot_one_digit"
        after = (six.packed, six.sub_scales, six.super_scales, one_digit)
        if int6_before:
            return ("int6_dot", "int6_dot"), (after, after)
        # Only the int8 side needs the head dequantised (a 128k-token head: 1 GB of float32 for the moment).
        eight = Int8DotLinear.build(int8_from_dense(weight.dequantize()), None, torch.float32, kernels)
        before = (eight.packed, ONE_DIGIT_GROUP if one_digit else eight.group_size, eight.scales, one_digit)
        return ("int8_dot", "int6_dot"), (before, after)
    if op.startswith("int8_dot"):
        values = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=generator)
        head = Int8DotLinear.build(
            Int8Weight(values, torch.rand(outputs, generator=generator) * 0.01), None, torch.float32, kernels
        )
        one_digit = op == "int8_dot_one_digit"
        arguments = (head.packed, ONE_DIGIT_GROUP if one_digit else head.group_size, head.scales, one_digit)
        return ("int8_dot", "int8_dot"), (arguments, arguments)
    weight4 = random_int4(outputs, inputs, generator=generator)
    if symmetric:
        weight4 = dataclasses.replace(weight4, zeros=torch.zeros_like(weight4.zeros))
    linear = Int4DotLinear.build(weight4, None, kernels)
    stored = linear.zeros if linear.zeros.numel() else torch.zeros_like(linear.scales)
    before4 = (linear.packed, linear.group_size, linear.scales, stored)
    return (op, op), (before4, (linear.packed, linear.group_size, linear.scales, linear.zeros))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kernel-ab", description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the commit whose kernels are 'before' (default HEAD)")
    parser.add_argument("--build", help="a build name (avx512_bf16, avx512_vnni, avx2); default: the best here")
    parser.add_argument("--op", choices=OPS, default="int4_dot")
    parser.add_argument("--shapes", choices=tuple(SHAPES), default="smollm2", help="whose projections (or LM head)")
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--inner", type=int, default=20, help="calls per timed sample")
    parser.add_argument(
        "--stream-mb", type=float, default=0.0, help="cycle through weight copies of at least this many MB in all"
    )
    parser.add_argument(
        "--symmetric",
        action="store_true",
        help="int4 weights whose zeros are all 0 (Q4_0's)",
    )
    parser.add_argument(
        "--int6-before", action="store_true", help="int6_dot ops: the other commit's int6_dot (default: its int8_dot)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        shapes = shapes_for(args.op, args.shapes)
    except ValueError as error:
        parser.error(str(error))
    builds = [b for b in native.builds_for(cpu_features()) if args.build in (None, b.name)]
    kernels = next((k for k in map(native.load_kernels, builds) if k is not None and k.has_int4_dot), None)
    if kernels is None:
        parser.error(f"no build with int4_dot among {[b.name for b in builds] or args.build} on this CPU")
    with tempfile.TemporaryDirectory() as scratch:
        commit = revision_sources(args.against, Path(scratch))
        before_ops = compile_revision(Path(scratch) / "engine" / "csrc", kernels.build, commit)
    rows = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    results = compare(
        before_ops,
        kernels.ops,
        rows,
        dtype,
        args.rounds,
        args.inner,
        kernels,
        args.op,
        shapes,
        args.stream_mb,
        args.symmetric,
        args.int6_before,
    )
    given = list(argv) if argv is not None else sys.argv[1:]
    document = {
        "command": "python -m benchmarks kernel-ab " + " ".join(given),
        "against": commit,
        "build": kernels.build.name,
        "dtype": args.dtype,
        "op": args.op,
        "shapes": args.shapes,
        "stream_mb": args.stream_mb,
        "symmetric": args.symmetric,
        "int6_before": args.int6_before,
        "threads": torch.get_num_threads(),
        "results": results,
    }
    write_json(args.out / "result.json", document)
    return 0
