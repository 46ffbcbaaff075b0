"""Run one workload against an already running OpenAI-compatible server; print a table, write JSON.

    python -m benchmarks serve --base-url http://127.0.0.1:8000 --workload mixed --num-prompts 48 \
        --request-rate 4 --goodput ttft:500 e2e:10000 --out result.json

Against `batchserve compare`, `--prefix /dynamic` or `--prefix /continuous` picks the mode.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.loadgen.client import discover_model
from benchmarks.loadgen.flags import add_load_arguments, run_config, workload_config
from benchmarks.loadgen.run import RunConfig, run_benchmark
from benchmarks.loadgen.workloads import RequestSpec, build_workload
from benchmarks.results_io.report import write_json
from benchmarks.results_io.tables import format_run

_DESCRIPTION = "Run one workload against a running OpenAI-compatible server."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serve", description=_DESCRIPTION)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--prefix", default="", help="path before /v1: /dynamic or /continuous for `batchserve compare`"
    )
    parser.add_argument("--model", default=None, help="model field to send; default: first of /v1/models")
    parser.add_argument("--label", default=None, help="name of this run in the output")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    add_load_arguments(parser)
    return parser


async def _main(args: argparse.Namespace, specs: list[RequestSpec], config: RunConfig, command: str) -> int:
    if config.client.model is None:
        discovered = await discover_model(args.base_url)
        config = dataclasses.replace(config, client=dataclasses.replace(config.client, model=discovered))
    result = await run_benchmark(specs, config)
    print(format_run(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "command": command,
            "base_url": args.base_url,
            "model": config.client.model,
            "workload": args.workload,
            "num_prompts": args.num_prompts,
            "seed": args.seed,
            "ignore_eos": args.ignore_eos,
            "result": result.to_dict(),
        }
        write_json(args.out, document)
        print(f"wrote {args.out}")
    return 0 if result.summary.completed else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prefix and not args.prefix.startswith("/"):
        parser.error(f"--prefix must start with /, got {args.prefix!r}")
    args.base_url = args.base_url.rstrip("/") + args.prefix.rstrip("/")  # every URL below is built on it
    try:
        specs = build_workload(workload_config(args))
        config = run_config(args, args.base_url, args.label or f"{args.workload}@{args.base_url}", args.model)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    command = shlex.join([sys.executable, "-m", "benchmarks", "serve", *argv])
    return asyncio.run(_main(args, specs, config, command))
