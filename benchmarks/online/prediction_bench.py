"""What Predicted Outputs (`prediction`) save at batch 1: decode ms per token of the same greedy answer with no
prediction, with the answer itself as the prediction (right), and with the passage the prompt asks to rewrite (what
an editor sends: partly right), on a live server, one request at a time.

    python -m benchmarks prediction [--mode continuous] [--max-tokens 128] [--rounds 3] [--out DIR]

Each prompt asks to copy or lightly edit a passage given in it. A first, unmeasured request per prompt gets the
greedy answer; then each round sends every prompt once per arm, the arms interleaved, so a drift in the machine's
speed reaches all three alike. Decode ms per token is the server's own `timings.decode_time_ms` over the tokens
after the first; the answer must be the same text in every arm (the report says whether it was). The ratio is the
median over rounds and prompts of no prediction's ms per token over the arm's.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.peers.targets import ServerSettings, batchserve_target
from benchmarks.results_io.machine import dated_result_dir
from benchmarks.results_io.report import write_json

PASSAGES = (
    "The river runs through the old town, past the market and the church, and out into the fields where the "
    "farmers grow wheat and barley. In spring the water rises and the children watch the boats go by.",
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n",
    "Our shop opens at nine in the morning and closes at six in the evening. On Sundays we open at ten. "
    "We sell bread, cakes, coffee and tea, and you can sit at the tables by the window.",
)
TASKS = ("Copy this text exactly:\n\n{}", "Repeat the following, word for word:\n\n{}")
ARMS = ("none", "right", "passage")


@dataclass(frozen=True)
class Sample:
    arm: str
    prompt: int
    round: int
    tokens: int
    ms_per_token: float
    accepted: int
    rejected: int
    same_answer: bool


def prompts() -> list[tuple[str, str]]:
    """(prompt, the passage it quotes)."""
    return [(task.format(passage), passage) for task in TASKS for passage in PASSAGES]


def ask(client: httpx.Client, prompt: str, max_tokens: int, prediction: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return dict(response.json())


def measure(base_url: str, max_tokens: int, rounds: int) -> list[Sample]:
    samples = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        cases = prompts()
        answers = [ask(client, p, max_tokens, None)["choices"][0]["message"]["content"] for p, _ in cases]
        for round_ in range(rounds):
            for index, (prompt, passage) in enumerate(cases):
                for arm in ARMS:
                    guess = {"none": None, "right": answers[index], "passage": passage}[arm]
                    done = ask(client, prompt, max_tokens, guess)
                    tokens = int(done["usage"]["completion_tokens"])
                    details = done["usage"].get("completion_tokens_details") or {}
                    samples.append(
                        Sample(
                            arm, index, round_, tokens,
                            float(done["timings"]["decode_time_ms"]) / max(tokens - 1, 1),
                            int(details.get("accepted_prediction_tokens", 0)),
                            int(details.get("rejected_prediction_tokens", 0)),
                            done["choices"][0]["message"]["content"] == answers[index],
                        )
                    )  # fmt: skip
                    print(f"round {round_ + 1} prompt {index} {arm}: {samples[-1].ms_per_token:.2f} ms/token")
    return samples


def summary(samples: Sequence[Sample]) -> dict[str, Any]:
    by_key = {(s.arm, s.prompt, s.round): s for s in samples}
    result: dict[str, Any] = {}
    for arm in ARMS:
        mine = [s for s in samples if s.arm == arm]
        ratios = [by_key[("none", s.prompt, s.round)].ms_per_token / s.ms_per_token for s in mine]
        result[arm] = {
            "ms_per_token_median": statistics.median(s.ms_per_token for s in mine),
            "speedup_over_none_median": statistics.median(ratios),
            "accepted": sum(s.accepted for s in mine),
            "rejected": sum(s.rejected for s in mine),
            "tokens": sum(s.tokens for s in mine),
            "same_answer": all(s.same_answer for s in mine),
        }
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks prediction", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="continuous", choices=("static", "dynamic", "continuous"))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="batchserve --model (default: its default model)")
    parser.add_argument(
        "--speculative-config", default=None, help="batchserve --speculative-config (its k sets the drafts a step)"
    )
    parser.add_argument("--out", type=Path, default=None, help="result folder (default: prediction/<date>-<cpu>)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out or dated_result_dir("prediction")
    target = batchserve_target("prediction", args.mode, ServerSettings(seats=1, model=args.model))
    extra = ("--speculative-config", args.speculative_config) if args.speculative_config else ()
    with ServerProcess(LaunchConfig((*target.argv, *extra), health_timeout_s=900), out / "server.log") as server:
        samples = measure(server.base_url, args.max_tokens, args.rounds)
    result = summary(samples)
    for arm, figures in result.items():
        print(f"{arm}: {figures}")
    command = "python -m benchmarks prediction " + " ".join(argv if argv is not None else [])
    document = {"command": command.strip(), "summary": result, "samples": [asdict(s) for s in samples]}
    print(write_json(out / "result.json", document))
    return 0
