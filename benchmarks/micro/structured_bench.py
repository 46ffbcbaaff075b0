"""What structured outputs cost: compiling a typical JSON schema (cold and cached), the decode throughput of a batch in
which half the rows follow a JSON schema against the same batch with every row free, and the sampler's share of a
decode step with and without constrained rows.

The two batches run interleaved (free, half, half, free, ...) on one engine and one set of weights, and the medians
are compared, so the ratio holds on a noisy machine. The constrained rows follow a schema whose array must hold many
objects, so no row ends within the measured steps; free rows ignore EOS for the same reason. The sampler's time is
that of `sample_and_record`, which masks, samples and advances the grammars.

    python -m benchmarks structured [--batch 16] [--decode-steps 48] [--repeats 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import engine.engine as engine_module
from api.structured.spec import GrammarKind, GrammarSpec
from api.structured.xgrammar_backend import XGrammarCompiler
from benchmarks.micro.model_flags import add_model_arguments, load_from_args
from benchmarks.results_io.report import write_json
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.model_runner import TransformersRunner
from engine.sample.grammar import Grammar
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import LoadedModel

# A typical API schema: nested objects, an array of objects, enums, numbers, a date.
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
            "required": ["name", "email"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
            },
        },
        "status": {"enum": ["pending", "paid", "shipped"]},
        "placed_on": {"type": "string", "format": "date"},
    },
    "required": ["order_id", "customer", "items", "status", "placed_on"],
}
# The decode benchmark's schema: the typical one's items, at least this many, so no row's grammar ends early.
LONG_SCHEMA = {"type": "array", "items": TYPICAL_SCHEMA["properties"]["items"]["items"], "minItems": 200}  # type: ignore[index]


def _spec(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), "bench")


def compile_times(loaded: LoadedModel, vocab: int, repeats: int) -> dict[str, float]:
    """Milliseconds: the compiler's tokenizer table, the schema's first compile on a fresh compiler, and again."""
    tables, colds, cached = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        compiler = XGrammarCompiler.for_tokenizer(loaded.tokenizer, vocab, loaded.eos_token_ids)
        tables.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(_spec(TYPICAL_SCHEMA))
        colds.append(time.perf_counter() - start)
        for _ in range(20):
            start = time.perf_counter()
            compiler.compile(_spec(TYPICAL_SCHEMA))
            cached.append(time.perf_counter() - start)
    return {
        "tokenizer_table_ms": statistics.median(tables) * 1000,
        "compile_cold_ms": statistics.median(colds) * 1000,
        "compile_cached_ms": statistics.median(cached) * 1000,
    }


@contextmanager
def timed_sampler() -> Iterator[list[float]]:
    """Record the seconds of every `sample_and_record` the engine calls, for as long as the block runs."""
    original: Callable[..., Any] = engine_module.sample_and_record
    seconds: list[float] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    engine_module.sample_and_record = timed  # type: ignore[assignment]
    try:
        yield seconds
    finally:
        engine_module.sample_and_record = original  # type: ignore[assignment]


def decode_pass(
    engine: Engine,
    prompts: list[list[int]],
    grammars: list[Grammar | None],
    steps: int,
    logit_bias: tuple[tuple[int, float], ...] = (),
) -> tuple[float, float]:
    """(seconds per decode step, sampler seconds per decode step) after one prefill step of every prompt; every
    row gets `logit_bias` (tool-cost biases end tokens away: ignore_eos does not stop a grammar ending on one)."""
    ids = list(range(len(prompts)))
    for seq_id, prompt, grammar in zip(ids, prompts, grammars, strict=True):
        params = SamplingParams(
            max_tokens=steps + 1, temperature=0.0, ignore_eos=True, logit_bias=logit_bias, grammar=grammar
        )
        engine.add(seq_id, prompt, params)
        assert engine.reserve(seq_id, len(prompt) + steps + 1)
    engine.step([(s, len(p)) for s, p in zip(ids, prompts, strict=True)])
    with timed_sampler() as sampler:
        start = time.perf_counter()
        for step in range(steps):
            out = engine.step([(s, 1) for s in ids])
            ended = [t.seq_id for t in out.tokens if t.finish_reason is not None]
            assert step == steps - 1 or not ended, f"rows {ended} ended early: the batches would not compare"
        elapsed = time.perf_counter() - start
    for seq_id in ids:
        engine.remove(seq_id)
    return elapsed / steps, sum(sampler) / steps


def decode_engine(loaded: LoadedModel, batch: int, steps: int, prompt_len: int) -> tuple[Engine, XGrammarCompiler]:
    """An engine with a row for each of `batch` sequences of `prompt_len + steps` tokens, and a grammar compiler for
    its vocabulary: what decode_pass runs on."""
    runner = TransformersRunner(loaded.model, quantized=loaded.quantized)
    engine = Engine(
        runner,
        EngineConfig(max_rows=batch, kv_cache_tokens=batch * (prompt_len + steps + 32)),
        loaded.eos_token_ids,
        loaded.max_model_len,
        dtype=runner.dtype,
    )
    return engine, XGrammarCompiler.for_tokenizer(loaded.tokenizer, runner.vocab_size, loaded.eos_token_ids)


@torch.inference_mode()
def decode_costs(loaded: LoadedModel, batch: int, steps: int, repeats: int, prompt_len: int = 32) -> dict[str, float]:
    engine, compiler = decode_engine(loaded, batch, steps, prompt_len)
    grammar = compiler.compile(_spec(LONG_SCHEMA))
    generator = torch.Generator().manual_seed(batch)
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    order = [False, True, True, False]
    for attempt in range(2 * repeats + 2):  # the first two passes warm up
        half = order[attempt % 4]
        prompts = [
            torch.randint(100, engine.runner.vocab_size - 1, (prompt_len,), generator=generator).tolist()
            for _ in range(batch)
        ]
        grammars: list[Grammar | None] = [grammar if half and i % 2 else None for i in range(batch)]
        result = decode_pass(engine, prompts, grammars, steps)
        if attempt >= 2:
            results[half].append(result)
    free_step, free_sampler = (statistics.median(r[i] for r in results[False]) for i in (0, 1))
    half_step, half_sampler = (statistics.median(r[i] for r in results[True]) for i in (0, 1))
    return {
        "batch": batch,
        "constrained_rows": batch // 2,
        "decode_tok_s_free": batch / free_step,
        "decode_tok_s_half_constrained": batch / half_step,
        "throughput_half_over_free": free_step / half_step,
        "step_ms_free": free_step * 1000,
        "step_ms_half_constrained": half_step * 1000,
        "sampler_ms_free": free_sampler * 1000,
        "sampler_ms_half_constrained": half_sampler * 1000,
        "sampler_share_free": free_sampler / free_step,
        "sampler_share_half_constrained": half_sampler / half_step,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4, help="measured passes per batch kind")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    loaded = load_from_args(args)
    vocab = int(loaded.model.config.vocab_size)
    compiled = compile_times(loaded, vocab, repeats=5)
    print(
        f"compile of a typical schema: {compiled['compile_cold_ms']:.2f} ms cold, "
        f"{compiled['compile_cached_ms']:.3f} ms cached (the compiler's tokenizer table, once per server: "
        f"{compiled['tokenizer_table_ms']:.0f} ms)",
        flush=True,
    )
    decode = decode_costs(loaded, args.batch, args.decode_steps, args.repeats)
    print(
        f"batch {decode['batch']}, {decode['constrained_rows']} rows constrained: decode "
        f"{decode['decode_tok_s_half_constrained']:.1f} tok/s against {decode['decode_tok_s_free']:.1f} free "
        f"({decode['throughput_half_over_free']:.3f}x); sampler {decode['sampler_ms_half_constrained']:.2f} ms of a "
        f"{decode['step_ms_half_constrained']:.2f} ms step ({decode['sampler_share_half_constrained']:.1%}) against "
        f"{decode['sampler_ms_free']:.2f} ms of {decode['step_ms_free']:.2f} ms ({decode['sampler_share_free']:.1%})",
        flush=True,
    )
    if args.out:
        write_json(args.out, {"weights": loaded.weight_format.label, "compile": compiled, "decode": decode})
