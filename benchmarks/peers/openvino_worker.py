"""OpenVINO GenAI's side of `openvino-probe`, run by the OpenVINO venv's python: imports only openvino_genai and the
standard library (the venv has nothing of batchserve).

    python openvino_worker.py MODEL_DIR [--property KEY=VALUE ...]

Loads an LLMPipeline on the CPU, prints one JSON line (`ready`), then answers each JSON line on stdin,
`{"prompts": [text, ...], "tokens": N}`, with one JSON line: greedy generation of exactly N tokens for every prompt
at once (eos ignored), timed by the pipeline's own perf metrics. Prompts are tokenized without special tokens and
must be of one length, so the batch needs no padding. End of stdin ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import openvino_genai


def parse_property(text: str) -> tuple[str, Any]:
    """KEY=VALUE; an integer value is passed as one (INFERENCE_NUM_THREADS=2), anything else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, int(value) if value.isdigit() else value


def measure(pipe: Any, tokenizer: Any, prompts: list[str], tokens: int) -> dict[str, Any]:
    lengths = [int(tokenizer.encode(p, add_special_tokens=False).input_ids.shape[1]) for p in prompts]
    if len(set(lengths)) != 1:
        return {"error": f"prompts of different lengths {sorted(set(lengths))} would be padded"}
    inputs = tokenizer.encode(prompts, add_special_tokens=False)
    config = pipe.get_generation_config()
    config.max_new_tokens = tokens
    config.min_new_tokens = tokens
    config.ignore_eos = True
    config.do_sample = False
    start = time.perf_counter()
    result = pipe.generate(inputs, config)
    wall_ms = (time.perf_counter() - start) * 1000
    metrics = result.perf_metrics
    raw = metrics.raw_metrics
    return {
        "input_tokens": lengths,
        "generated_tokens": [len(t) for t in result.tokens],
        "ttft_ms": float(metrics.get_ttft().mean),
        "tpot_ms": float(metrics.get_tpot().mean),  # per output token after the first, across the batch
        "throughput_tok_s": float(metrics.get_throughput().mean),
        "generate_ms": float(metrics.get_generate_duration().mean),
        "step_ms": [float(us) / 1000 for us in raw.token_infer_durations],  # each model call; the first prefills
        "batch_sizes": [int(b) for b in raw.m_batch_sizes],
        "wall_ms": wall_ms,
    }


def emit(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--property", type=parse_property, action="append", default=[], help="KEY=VALUE, repeatable")
    args = parser.parse_args(argv)
    properties = dict(args.property)
    start = time.perf_counter()
    pipe = openvino_genai.LLMPipeline(args.model_dir, "CPU", **properties)
    emit(
        {
            "ready": True,
            "version": openvino_genai.get_version(),
            "properties": properties,
            "load_s": time.perf_counter() - start,
        }
    )
    tokenizer = pipe.get_tokenizer()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            emit(measure(pipe, tokenizer, list(request["prompts"]), int(request["tokens"])))
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # report it; the probe decides
            emit({"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
