"""Run one workload against an already running OpenAI-compatible server; print a table, write JSON.

    python -m benchmarks serve --base-url http://127.0.0.1:8000 --workload mixed --num-prompts 48 \
        --request-rate 4 --goodput ttft:500 e2e:10000 --out result.json

Against `batchserve compare`, `--prefix /dynamic` or `--prefix /continuous` picks the mode.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.loadgen.arrivals import ArrivalConfig
from benchmarks.loadgen.client import ClientConfig, EosPolicy, discover_model
from benchmarks.loadgen.run import RunConfig, run_benchmark
from benchmarks.loadgen.summaries import SLO
from benchmarks.loadgen.workloads import WORKLOADS, RequestSpec, WorkloadConfig, build_workload
from benchmarks.results_io.tables import format_run

_DESCRIPTION = "Run one workload against a running OpenAI-compatible server."
_W = WorkloadConfig()
_A = ArrivalConfig()


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload, arrival and client flags shared with benchmarks.online.ab."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default=_W.name)
    g.add_argument("--num-prompts", type=int, default=_W.num_prompts)
    g.add_argument("--seed", type=int, default=_W.seed, help="seeds the prompts, the arrivals and sampling")
    g.add_argument("--jsonl-path", default=None, help="for --workload jsonl: lines of {prompt, max_tokens}")
    g.add_argument("--input-len", type=int, default=_W.input_len, help="uniform: prompt words")
    g.add_argument("--output-len", type=int, default=_W.output_len, help="uniform: max_tokens")
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=_A.request_rate, help="req/s; inf sends all at once")
    g.add_argument("--burstiness", type=float, default=_A.burstiness, help="gamma shape; 1.0 is Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly max_tokens (off: natural stopping)",
    )
    g.add_argument(
        "--eos-field",
        choices=("ignore_eos", "generation_config"),
        default="ignore_eos",
        help="how --ignore-eos is asked: ignore_eos (vLLM, batchserve, llama-server) or a generation_config "
        "with min_new_tokens (transformers serve, which rejects unknown fields)",
    )
    g.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:500 e2e:10000")
    g.add_argument("--warmup", type=int, default=1, help="warm-up requests, excluded from results")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--no-progress", action="store_true")


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        name=args.workload,
        num_prompts=args.num_prompts,
        seed=args.seed,
        jsonl_path=args.jsonl_path,
        input_len=args.input_len,
        output_len=args.output_len,
    )


def run_config(
    args: argparse.Namespace,
    base_url: str,
    label: str,
    model: str | None,
    request_rate: float | None = None,
    eos_policy: EosPolicy | None = None,
) -> RunConfig:
    if not args.ignore_eos:
        eos_policy = EosPolicy.NATURAL
    elif eos_policy is None:
        eos_policy = EosPolicy.IGNORE_EOS if args.eos_field == "ignore_eos" else EosPolicy.HF_MIN_NEW_TOKENS
    return RunConfig(
        label=label,
        client=ClientConfig(
            base_url=base_url,
            model=model,
            temperature=args.temperature,
            seed=args.seed,
            eos_policy=eos_policy,
            max_concurrency=args.max_concurrency,
            request_timeout_s=args.request_timeout,
            show_progress=not args.no_progress,
            progress_label=label,
        ),
        arrivals=ArrivalConfig(
            request_rate=args.request_rate if request_rate is None else request_rate,
            burstiness=args.burstiness,
            seed=args.seed,
        ),
        slo=SLO.parse(args.goodput),
        warmup_requests=args.warmup,
    )


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
        args.out.write_text(json.dumps(document, indent=2) + "\n")
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
