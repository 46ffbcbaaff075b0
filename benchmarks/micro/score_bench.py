"""Prompt scoring cost: prefill tokens/s with and without prompt logprobs, on the real model.

Scoring a prompt (lm-eval's loglikelihood, `echo` with `logprobs`, vLLM's `prompt_logprobs`) runs the LM head
over every prompt position instead of only the last one, then reduces each position's logits to its logprob,
rank and top alternatives. For each batch size the script prefills the same prompts (all of them whole in one
step, as dynamic mode does) once plainly and once with `prompt_logprobs=k`, alternating which goes first, and
reports the medians. Warm-up runs are excluded. The machine is noisy, so the ratio compares runs taken side by
side.

    python -m benchmarks score [--batch-sizes 1,16] [--repeats 7] [--top-k 1] [--threads N] [--out FILE]

On a shared machine, `--threads 1` gives steadier ratios: with two threads each parallel op waits for its
slower thread, which a busy machine delays at random.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.micro.engine_bench import BenchConfig, mixed_prompts, timed
from benchmarks.micro.rows import add_row
from benchmarks.results_io.machine import dated_result_dir
from benchmarks.results_io.report import write_json
from engine.config import EngineConfig
from engine.engine import Engine
from engine.loader import LoadedModel, load_model
from engine.model_runner import TransformersRunner
from engine.sampling_params import SamplingParams

TARGET_RATIO = 0.7  # scoring keeps at least this share of plain prefill throughput


@dataclass(frozen=True)
class ScoreBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 16)
    repeats: int = 7
    top_k: int = 1
    min_prompt: int = 64
    max_prompt: int = 192

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch sizes must be positive")
        if self.repeats < 1 or not 0 < self.min_prompt <= self.max_prompt:
            raise ValueError("need at least 1 repeat and 0 < min_prompt <= max_prompt")


@dataclass(frozen=True)
class Row:
    batch: int
    prompt_tokens: int
    plain_tok_s: float  # median over repeats
    scored_tok_s: float
    ratio: float  # median of the per-repeat ratios (scored over plain, each pair taken back to back)
    plain_runs_s: tuple[float, ...]
    scored_runs_s: tuple[float, ...]


def prefill_seconds(engine: Engine, prompts: list[list[int]], prompt_logprobs: int | None) -> float:
    """One step prefilling every prompt whole (and sampling each one's first token)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    for seq_id, prompt in enumerate(prompts):
        add_row(engine, seq_id, prompt, params, len(prompt) + 1, "the KV cache is too small for the prompts")
    plan = [(seq_id, len(prompt)) for seq_id, prompt in enumerate(prompts)]
    seconds = timed(lambda: engine.step(plan))
    for seq_id in range(len(prompts)):
        engine.remove(seq_id)
    return seconds


def measure(loaded: LoadedModel, runner: TransformersRunner, prompts: list[list[int]], config: ScoreBenchConfig) -> Row:
    longest = max(map(len, prompts)) + 1
    engine = Engine(
        runner,
        EngineConfig(
            seats=len(prompts),
            kv_cache_tokens=len(prompts) * (longest + 16),
            max_model_len=longest,
            enable_prefix_caching=False,  # repeated prompts are timed: each must be computed
        ),
        loaded.eos_token_ids,
        loaded.max_model_len,
    )
    conditions = {"plain": None, "scored": config.top_k}
    for k in conditions.values():  # warm-up
        prefill_seconds(engine, prompts, k)
    runs: dict[str, list[float]] = {name: [] for name in conditions}
    for repeat in range(config.repeats):
        order = list(conditions) if repeat % 2 == 0 else list(reversed(conditions))  # cancel drift
        for name in order:
            runs[name].append(prefill_seconds(engine, prompts, conditions[name]))
    tokens = sum(map(len, prompts))
    plain, scored = statistics.median(runs["plain"]), statistics.median(runs["scored"])
    return Row(
        batch=len(prompts),
        prompt_tokens=tokens,
        plain_tok_s=tokens / plain,
        scored_tok_s=tokens / scored,
        ratio=statistics.median(p / s for p, s in zip(runs["plain"], runs["scored"], strict=True)),
        plain_runs_s=tuple(runs["plain"]),
        scored_runs_s=tuple(runs["scored"]),
    )


def run(config: ScoreBenchConfig, loaded: LoadedModel) -> dict[str, object]:
    runner = TransformersRunner(loaded.model)
    vocab = int(loaded.model.config.vocab_size)
    lengths = BenchConfig(min_prompt=config.min_prompt, max_prompt=config.max_prompt)
    rows = []
    for batch in config.batch_sizes:
        row = measure(loaded, runner, mixed_prompts(batch, lengths, vocab), config)
        rows.append(row)
        print(
            f"batch {row.batch:>3} ({row.prompt_tokens} prompt tokens): plain {row.plain_tok_s:7.1f} tok/s, "
            f"scored (k={config.top_k}) {row.scored_tok_s:7.1f} tok/s -> {row.ratio:.2f}x",
            flush=True,
        )
    targets = {
        f"scored_vs_plain_b{r.batch}": {
            "value": r.ratio,
            "target": f">= {TARGET_RATIO}",
            "met": r.ratio >= TARGET_RATIO,
        }
        for r in rows
    }
    return {
        "config": asdict(config),
        "threads": torch.get_num_threads(),
        "score_slice": runner.score_slice,
        "rows": [asdict(r) for r in rows],
        "targets": targets,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks score", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--top-k", type=int, default=1, help="prompt_logprobs: alternatives per position")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the result as JSON here (default: benchmarks/results/score/<YYYY-MM-DD>-<machine>/result.json)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out or dated_result_dir("score") / "result.json"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = ScoreBenchConfig(
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")), repeats=args.repeats, top_k=args.top_k
    )
    result = run(config, load_model(args.model))
    targets: dict[str, dict[str, object]] = result["targets"]  # type: ignore[assignment]
    for name, target in targets.items():
        print(
            f"target {name}: {target['value']:.3f} (want {target['target']}) -> {'met' if target['met'] else 'NOT met'}"
        )
    write_json(out, result)
