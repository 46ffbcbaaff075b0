"""Command-line flags shared by the commands that drive a load or size a server: the workload, arrival and client
flags and their configs, `--seats`, and rate lists. One definition each, so `serve`, `ab`, `simulate` and the rest
read them the same way."""

from __future__ import annotations

import argparse

from benchmarks.loadgen.arrivals import ArrivalConfig
from benchmarks.loadgen.client import ClientConfig, EosPolicy
from benchmarks.loadgen.run import RunConfig
from benchmarks.loadgen.summaries import SLO
from benchmarks.loadgen.workloads import WORKLOADS, WorkloadConfig

DEFAULT_SEATS = 8
SEATS_HELP = "dynamic max-batch-size = continuous max-num-seqs"


def add_seats_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str = SEATS_HELP) -> None:
    """`--seats`: how many requests a server holds at once, the one size both batching modes are compared at."""
    parser.add_argument("--seats", type=int, default=DEFAULT_SEATS, help=help)


def parse_rates(text: str) -> tuple[float, ...]:
    """`--sweep-rates`: a comma list of request rates (req/s), each > 0; `inf` sends all at once."""
    rates = tuple(float(part) for part in text.split(",") if part.strip())
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"--sweep-rates needs positive numbers or inf, got {text!r}")
    return rates


_W = WorkloadConfig()
_A = ArrivalConfig()


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload, arrival and client flags: every command that sends a workload takes the same ones."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default=_W.name)
    g.add_argument("--num-prompts", type=int, default=_W.num_prompts)
    g.add_argument("--seed", type=int, default=_W.seed, help="seeds the prompts, the arrivals and sampling")
    g.add_argument("--jsonl-path", default=None, help="for --workload jsonl: lines of {prompt, max_tokens}")
    g.add_argument("--input-len", type=int, default=_W.input_len, help="uniform: prompt words")
    g.add_argument("--output-len", type=int, default=_W.output_len, help="uniform: max_tokens")
    g.add_argument("--turns", type=int, default=_W.turns, help="multi-turn and agent: turns per conversation")
    g.add_argument(
        "--system-prompt-words",
        type=int,
        default=_W.system_prompt_words,
        help="multi-turn and agent: the shared system prompt",
    )
    g.add_argument("--agent-tools", type=int, default=_W.agent_tools, help="agent: tools every request offers")
    g.add_argument(
        "--agent-max-tokens", type=int, default=_W.agent_max_tokens, help="agent: at most this many tokens a turn"
    )
    g.add_argument("--prefix-groups", type=int, default=_W.prefix_groups, help="shared-prefix: distinct prefixes")
    g.add_argument("--prefix-words", type=int, default=_W.prefix_words, help="shared-prefix: words of each prefix")
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
        turns=args.turns,
        system_prompt_words=args.system_prompt_words,
        agent_tools=args.agent_tools,
        agent_max_tokens=args.agent_max_tokens,
        prefix_groups=args.prefix_groups,
        prefix_words=args.prefix_words,
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
