"""Batch 1, batch N and a long prompt's time to first token: OpenVINO GenAI against batchserve's engine, both
in-process on the same prompts, interleaved round by round so that the ratios come from one run.

    python -m benchmarks openvino-probe [--ov-weights int4|fp32] [--ov-property KEY=VALUE] \
        [--dtype auto] [--quantization auto] [--int4-gemm auto] [--rounds 3] [--batch 32] [--tokens 128] [--out DIR]

OpenVINO runs in its own venv (`python -m benchmarks openvino-build build`) as a subprocess
(`peers/openvino_worker.py`, an LLMPipeline on the CPU), loaded once and asked for one measurement at a time;
batchserve's engine runs here through the `engine` benchmark's own passes (`engine_bench.engine_seconds`), with the
runner the server builds for `--dtype`/`--quantization`. Each round measures, for each of the three figures,
both sides back to back, alternating which goes first:

- batch 1: greedy decode of `--tokens` tokens after a `--prompt-tokens` prompt; ms per token after the first
  (OpenVINO: its perf metrics' TPOT; batchserve: the mean decode step);
- batch N: `--batch` such prompts at once; decode tok/s after the first token (OpenVINO: 1000 / TPOT, which it
  measures per token across the batch; batchserve: N over the mean decode step);
- TTFT: one `--long-prompt-tokens` prompt (OpenVINO: its TTFT, tokenization included, the prompt fed in its
  scheduler's chunks; batchserve: the one engine step that prefills the whole prompt, as the server does for a
  lone prompt of up to `--lone-prefill-tokens`).

Prompts are text made to tokenize to exactly the stated length under both tokenizers (checked: OpenVINO reports
the lengths it saw). Every request ignores eos, so each produces exactly the tokens asked. Both use every core this
process may run on (OpenVINO's INFERENCE_NUM_THREADS, torch's threads). `--out DIR` writes result.json (with the
machine and commit) and report.md with the table and the command to reproduce it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from api.config import INT4_GEMM_CHOICES
from benchmarks.loadgen.workloads import make_prompt
from benchmarks.peers.openvino import FORMAT_NOTES, WEIGHT_FORMATS, OpenVinoCache, default_cache, is_exported
from benchmarks.peers.openvino_client import OpenVinoWorker, ov_properties, worker_argv
from benchmarks.results_io.report import write_json
from engine.config import DTYPES, QUANTIZATIONS
from engine.weights.loader import default_model_path

# (figure, lower is better)
FIGURES = (("batch1_ms_per_token", True), ("batch_tok_s", False), ("long_prompt_ttft_ms", True))


@dataclass(frozen=True)
class ProbeConfig:
    rounds: int = 3
    batch: int = 32
    tokens: int = 128  # output tokens of the batch-1 and batch-N requests
    prompt_tokens: int = 64
    long_prompt_tokens: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.batch < 2 or self.tokens < 2 or self.prompt_tokens < 1:
            raise ValueError("need rounds >= 1, batch >= 2, tokens >= 2 and prompt_tokens >= 1")
        if self.long_prompt_tokens < self.prompt_tokens:
            raise ValueError("long_prompt_tokens must be at least prompt_tokens")


@dataclass(frozen=True)
class Sample:
    """One side's three figures in one round."""

    batch1_ms_per_token: float
    batch_tok_s: float
    long_prompt_ttft_ms: float


def exact_text(tokenizer: Any, text: str, tokens: int) -> str:
    """A prefix of `text` that tokenizes (without special tokens) to exactly `tokens` tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for end in range(tokens, min(len(ids), tokens + 8) + 1):
        candidate = tokenizer.decode(ids[:end])
        if len(tokenizer.encode(candidate, add_special_tokens=False)) == tokens:
            return str(candidate)
    raise ValueError(f"no prefix of the text tokenizes to exactly {tokens} tokens")


@dataclass(frozen=True)
class Prompts:
    single: str
    batch: tuple[str, ...]
    long: str


def make_prompts(tokenizer: Any, config: ProbeConfig) -> Prompts:
    rng = np.random.default_rng(config.seed)

    def one(tokens: int) -> str:
        return exact_text(tokenizer, make_prompt(rng, 2 * tokens + 16), tokens)

    return Prompts(
        single=one(config.prompt_tokens),
        batch=tuple(one(config.prompt_tokens) for _ in range(config.batch)),
        long=one(config.long_prompt_tokens),
    )


def token_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def summarise(rounds: Sequence[dict[str, Sample]]) -> dict[str, dict[str, float]]:
    """Per figure: each side's median over the rounds and the median of the per-round batchserve/OpenVINO ratios."""
    out: dict[str, dict[str, float]] = {}
    for name, _lower in FIGURES:
        ov = [getattr(r["openvino"], name) for r in rounds]
        bs = [getattr(r["batchserve"], name) for r in rounds]
        out[name] = {
            "openvino": statistics.median(ov),
            "batchserve": statistics.median(bs),
            "batchserve_over_openvino": statistics.median(b / o for b, o in zip(bs, ov, strict=True)),
        }
    return out


def format_table(summary: dict[str, dict[str, float]], batch: int, long_tokens: int) -> str:
    titles = {
        "batch1_ms_per_token": "batch 1 decode (ms/token)",
        "batch_tok_s": f"batch {batch} decode (tok/s)",
        "long_prompt_ttft_ms": f"TTFT, {long_tokens}-token prompt (ms)",
    }
    lines = ["| figure | OpenVINO GenAI | batchserve | batchserve / OpenVINO |", "|---|---:|---:|---:|"]
    for name, lower in FIGURES:
        row = summary[name]
        better = "lower is better" if lower else "higher is better"
        lines.append(
            f"| {titles[name]} | {row['openvino']:.1f} | {row['batchserve']:.1f} | "
            f"{row['batchserve_over_openvino']:.2f}x ({better}) |"
        )
    return "\n".join(lines)


def run_rounds(
    config: ProbeConfig, openvino: Callable[[str], float], batchserve: Callable[[str], float]
) -> list[dict[str, Sample]]:
    """Each round, each figure from both sides back to back, the first side alternating by round."""
    rounds = []
    for index in range(config.rounds):
        values: dict[str, dict[str, float]] = {"openvino": {}, "batchserve": {}}
        for name, _lower in FIGURES:
            sides = [("openvino", openvino), ("batchserve", batchserve)]
            for side, measure in sides if index % 2 == 0 else sides[::-1]:
                values[side][name] = measure(name)
        rounds.append({side: Sample(**figures) for side, figures in values.items()})
        print(f"round {index + 1}: {json.dumps({s: asdict(v) for s, v in rounds[-1].items()})}", flush=True)
    return rounds


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks openvino-probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ov-weights", default="int4", choices=sorted(WEIGHT_FORMATS), help="the exported IR")
    parser.add_argument(
        "--ov-property", action="append", default=[], help="KEY=VALUE for the OpenVINO CPU plugin, repeatable"
    )
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="batchserve's, as `serve --dtype`")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS, help="as `serve --quantization`")
    parser.add_argument(
        "--int4-gemm",
        default="auto",
        choices=INT4_GEMM_CHOICES,
        help="as `serve --int4-gemm` (except-qkv: int8 activations past the row switch, as OpenVINO's default)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="write result.json and report.md here")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    threads = cpu_count()
    try:
        config = ProbeConfig(args.rounds, args.batch, args.tokens, args.prompt_tokens, args.long_prompt_tokens)
        properties = ov_properties(args.ov_property, threads)
    except ValueError as exc:
        parser.error(str(exc))
    cache = default_cache()
    model_dir = cache.model_dir(default_model_path(), args.ov_weights)
    if not cache.is_built() or not is_exported(model_dir):
        print(f"OpenVINO is not built: run `python -m benchmarks openvino-build build` ({model_dir})", file=sys.stderr)
        return 1
    command = "python -m benchmarks openvino-probe " + shlex.join(argv if argv is not None else sys.argv[1:])
    return _measure(args, config, cache, model_dir, properties, threads, command)


def _measure(
    args: argparse.Namespace,
    config: ProbeConfig,
    cache: OpenVinoCache,
    model_dir: Path,
    properties: list[tuple[str, str]],
    threads: int,
    command: str,
) -> int:
    import torch

    from api.config import RuntimeOptions
    from api.runtime.build import build_runner, load
    from benchmarks.micro.engine_bench import engine_seconds

    torch.set_num_threads(threads)
    # As `serve` loads it: an `auto` format is the one measured and cached for this machine, with its row switch.
    options = RuntimeOptions(dtype=args.dtype, quantization=args.quantization, int4_gemm=args.int4_gemm)
    loaded = load(options)
    runner = build_runner(options, loaded)
    prompts = make_prompts(loaded.tokenizer, config)
    single = [token_ids(loaded.tokenizer, prompts.single)]
    batch = [token_ids(loaded.tokenizer, p) for p in prompts.batch]
    long = [token_ids(loaded.tokenizer, prompts.long)]
    print(f"batchserve: {loaded.weight_format.label}, {threads} threads; OpenVINO: {model_dir}", flush=True)

    def batchserve(name: str) -> float:
        if name == "batch1_ms_per_token":
            return engine_seconds(loaded, runner, single, config.tokens - 1, 1)[1] * 1000
        if name == "batch_tok_s":
            return config.batch / engine_seconds(loaded, runner, batch, config.tokens - 1, 1)[1]
        return engine_seconds(loaded, runner, long, 1, 1)[0] * 1000

    log_path = args.out / "openvino-worker.log" if args.out else Path(os.devnull)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    replies: list[dict[str, object]] = []
    with log_path.open("w") as log, OpenVinoWorker(worker_argv(cache.python, model_dir, properties), log) as worker:
        print(f"OpenVINO GenAI {worker.ready.get('version')}: {worker.ready.get('properties')}", flush=True)
        # Warm-up: the first request of each shape compiles and allocates.
        worker.generate([prompts.single], config.prompt_tokens, 4)
        worker.generate(list(prompts.batch), config.prompt_tokens, 4)
        worker.generate([prompts.long], config.long_prompt_tokens, 2)

        def openvino(name: str) -> float:
            if name == "batch1_ms_per_token":
                reply = worker.generate([prompts.single], config.prompt_tokens, config.tokens)
                value = reply.tpot_ms
            elif name == "batch_tok_s":
                reply = worker.generate(list(prompts.batch), config.prompt_tokens, config.tokens)
                value = reply.decode_tok_s
            else:
                reply = worker.generate([prompts.long], config.long_prompt_tokens, 2)
                value = reply.ttft_ms
            replies.append({"figure": name, **asdict(reply)})
            return value

        rounds = run_rounds(config, openvino, batchserve)
        ready = worker.ready
    summary = summarise(rounds)
    table = format_table(summary, config.batch, config.long_prompt_tokens)
    print(table)
    print(f"Reproduce: {command}")
    if args.out:
        document = {
            "command": command,
            "config": asdict(config),
            "threads": threads,
            "openvino": {
                "version": ready.get("version"),
                "model_dir": str(model_dir),
                "weights": args.ov_weights,
                "weights_note": FORMAT_NOTES[args.ov_weights],
                "properties": dict(properties),
                "load_s": ready.get("load_s"),
            },
            "batchserve": {
                "dtype": args.dtype,
                "quantization": args.quantization,
                "int4_gemm": args.int4_gemm,
                "weights": loaded.weight_format.label,
            },
            "summary": summary,
            "rounds": [{side: asdict(sample) for side, sample in r.items()} for r in rounds],
            "openvino_replies": replies,
        }
        write_json(args.out / "result.json", document)
        report = ["# openvino-probe", "", table, "", "## Reproduce", "", "```", command, "```", ""]
        (args.out / "report.md").write_text("\n".join(report))
    return 0
