"""What tool_choice auto's lazy grammar costs a decode step: a batch in which half the rows carry a tool parser's
lazy grammar, against the same batch with every row free, and against half the rows inside a constrained call.

    python -m benchmarks tool-cost [--parser hermes] [--batch 16] [--decode-steps 48] [--repeats 4] [--out FILE]

Three batches run interleaved on one engine and one set of weights, medians compared (as `structured` does):
- `free`: no row constrained;
- `lazy`: half the rows under the parser's grammar for two tools while their text runs free (the grammar still
  fills a mask every step: it is what lets the trigger through and holds what follows it);
- `in_call`: half the rows inside a call (the parser's tag, begun at once, with an argument list long enough that
  no call ends within the measured steps): what a row costs while its arguments are constrained.
The generic parser's grammar is a JSON schema's from the first token: `structured` measures that.
No row may end (its end tokens are biased away), so the batches stay whole; the sampler's time is
`sample_and_record`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from api.structured.spec import GrammarKind, GrammarSpec
from api.structured.tool_parsers.base import FunctionTool
from api.structured.tool_parsers.registry import PARSERS
from api.structured.xgrammar_backend import XGrammarCompiler
from benchmarks.micro.model_flags import add_model_arguments, load_from_args
from benchmarks.micro.structured_bench import decode_engine, decode_pass
from benchmarks.results_io.report import write_json
from engine.sample.grammar import Grammar

KINDS = ("free", "lazy", "in_call")
_CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
_NUMBERS = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [FunctionTool("get_weather", "Get the weather", _CITY), FunctionTool("add", "Add two numbers", _NUMBERS)]
# A call whose arguments cannot end within the measured steps: 200 items at least.
_LONG_TOOL = FunctionTool(
    "record",
    None,
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "integer"}, "minItems": 200}},
        "required": ["items"],
    },
)


def grammars(compiler: XGrammarCompiler, parser: str) -> dict[str, Grammar]:
    lazy = PARSERS[parser].grammar(TOOLS, parallel=True)
    forced = PARSERS[parser].grammar([_LONG_TOOL], parallel=True)
    tag = json.loads(forced.text)
    tag["format"] = tag["format"]["tags"][0]  # the call's tag at the root: the answer begins inside it
    forced = GrammarSpec(GrammarKind.STRUCTURAL_TAG, json.dumps(tag), forced.param)
    return {"lazy": compiler.compile(lazy), "in_call": compiler.compile(forced)}


@torch.inference_mode()
def step_costs(loaded: Any, parser: str, batch: int, steps: int, repeats: int, prompt_len: int = 32) -> dict:
    engine, compiler = decode_engine(loaded, batch, steps, prompt_len)
    compiled = grammars(compiler, parser)
    no_end = tuple((int(token), -100.0) for token in loaded.eos_token_ids)
    generator = torch.Generator().manual_seed(batch)
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    order = [*KINDS, *reversed(KINDS)]
    for attempt in range(len(KINDS) * (repeats + 1)):  # the first round warms up
        kind = order[attempt % len(order)]
        prompts = [
            torch.randint(100, engine.runner.vocab_size - 1, (prompt_len,), generator=generator).tolist()
            for _ in range(batch)
        ]
        rows: list[Grammar | None] = [compiled[kind] if kind != "free" and i % 2 else None for i in range(batch)]
        result = decode_pass(engine, prompts, rows, steps, no_end)
        if attempt >= len(KINDS):
            results[kind].append(result)
    out: dict[str, Any] = {"parser": parser, "batch": batch, "constrained_rows": batch // 2}
    for kind in KINDS:
        step, sampler = (statistics.median(r[i] for r in results[kind]) for i in (0, 1))
        out[kind] = {"step_ms": step * 1000, "sampler_ms": sampler * 1000, "tok_s": batch / step}
    for kind in KINDS[1:]:
        out[f"{kind}_over_free"] = out[kind]["step_ms"] / out["free"]["step_ms"]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks tool-cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    lazy_parsers = sorted(name for name in PARSERS if name != "generic")  # generic's grammar is a JSON schema's
    parser.add_argument("--parser", default="hermes", choices=lazy_parsers)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4, help="measured passes per batch kind")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    loaded = load_from_args(args)
    costs = step_costs(loaded, args.parser, args.batch, args.decode_steps, args.repeats)
    for kind in KINDS:
        c = costs[kind]
        print(f"{kind:>8}: step {c['step_ms']:.2f} ms, sampler {c['sampler_ms']:.2f} ms, {c['tok_s']:.1f} tok/s")
    print(f"lazy/free {costs['lazy_over_free']:.3f}x, in_call/free {costs['in_call_over_free']:.3f}x", flush=True)
    if args.out:
        write_json(args.out, {"weights": loaded.weight_format.label, **costs})
