"""What a conversation continued through `previous_response_id` costs against the same conversation with its whole
history resent, turn by turn: time to first token (TTFT) of turn n on a live server, prefix caching on (and off,
for reference).

    python -m benchmarks responses [--turns 8] [--repeats 5] [--caching on,off] [--out DIR]

Each conversation opens with a long system prompt (`instructions`, as agents send one) and asks a short question
per turn, streamed, greedy, with at most `--max-output-tokens` per answer. The chained arm sends only the new
question and the previous response's id; the resent arm sends every earlier turn as input items (the answers as
assistant messages) with `store: false`. Greedy answers make the two conversations the same text, so the prompts
are the same tokens (the report says whether every pair matched); each conversation has its own `cache_salt`, so
none reuses another's cache. The two arms run in lockstep, turn n of one right after turn n of the other, and are
compared pair by pair (the median of chained / resent). TTFT runs from sending the request to the first
`response.output_text.delta` event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.peers.targets import ServerSettings, batchserve_target
from benchmarks.results_io.report import write_json

SYSTEM = (
    "You are a careful assistant for a travel agency. Answer in one or two short sentences. "
    "Always name the city you talk about, never invent prices, and say so when you do not know. "
) * 12  # about 400 tokens: the long shared part an agent's every turn starts with
QUESTIONS = (
    "Which city is the capital of France?",
    "Name one museum there.",
    "What river runs through it?",
    "Which city is the capital of Italy?",
    "Name one old building there.",
    "Which of the two cities is further north?",
    "Which city is the capital of Spain?",
    "Name one park there.",
    "Which of the three cities did we talk about first?",
    "Thank you. Summarise our talk in one sentence.",
)
ARMS = ("chained", "resent")


@dataclass(frozen=True)
class Turn:
    caching: bool
    arm: str
    repeat: int
    turn: int  # 1-based
    ttft_s: float
    total_s: float
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    request_bytes: int


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, float, dict[str, Any], int]:
    """(TTFT, total time, the final response, the request's size) of one streamed request."""
    content = json.dumps(body).encode()
    start = time.perf_counter()
    first: float | None = None
    final: dict[str, Any] | None = None
    headers = {"content-type": "application/json"}
    async with client.stream("POST", "/v1/responses", content=content, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if first is None and event["type"] == "response.output_text.delta":
                first = time.perf_counter()
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    end = time.perf_counter()
    if final is None or final["status"] == "failed":
        raise RuntimeError(f"the response did not complete: {final}")
    return (first or end) - start, end - start, final, len(content)


def _text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


class Conversation:
    """One arm's conversation, a turn at a time."""

    def __init__(self, arm: str, max_output_tokens: int) -> None:
        self.arm = arm
        self.max_output_tokens = max_output_tokens
        self.salt = uuid.uuid4().hex  # its own cache: nothing cached from another conversation
        self.history: list[dict[str, Any]] = []
        self.previous: str | None = None

    async def turn(self, client: httpx.AsyncClient, n: int) -> tuple[float, float, dict[str, Any], int]:
        question = QUESTIONS[n % len(QUESTIONS)]
        body: dict[str, Any] = {
            "instructions": SYSTEM,
            "cache_salt": self.salt,
            "max_output_tokens": self.max_output_tokens,
            "temperature": 0,
            "stream": True,
        }
        if self.arm == "chained":
            body.update(input=question, previous_response_id=self.previous)
        else:
            body.update(input=[*self.history, {"role": "user", "content": question}], store=False)
        measured = await _stream(client, body)
        response = measured[2]
        self.previous = response["id"]
        self.history += [{"role": "user", "content": question}, {"role": "assistant", "content": _text(response)}]
        return measured


async def run(base_url: str, caching: bool, turns: int, repeats: int, max_output_tokens: int) -> list[Turn]:
    """The two arms' conversations in lockstep, turn n of one beside turn n of the other (which goes first
    alternates), so that a change in the machine's load falls on both alike."""
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as client:
        warm = Conversation("chained", max_output_tokens)
        for n in range(2):  # warm-up, not recorded
            await warm.turn(client, n)
        results: list[Turn] = []
        for repeat in range(repeats):
            arms = {arm: Conversation(arm, max_output_tokens) for arm in ARMS}
            for n in range(turns):
                for arm in ARMS if (repeat + n) % 2 == 0 else ARMS[::-1]:
                    ttft, total, response, size = await arms[arm].turn(client, n)
                    usage = response["usage"]
                    cached = usage["input_tokens_details"]["cached_tokens"]
                    tokens = (usage["input_tokens"], cached, usage["output_tokens"])
                    results.append(Turn(caching, arm, repeat, n + 1, ttft, total, *tokens, size))
            print(f"caching {'on' if caching else 'off'}, repeat {repeat}: done", flush=True)
    return results


def summary(results: Sequence[Turn]) -> list[dict[str, Any]]:
    """Per caching setting and turn: each arm's median TTFT and mean cached share, and the ratio of the medians."""
    rows = []
    for caching in sorted({r.caching for r in results}, reverse=True):
        for n in sorted({r.turn for r in results}):
            row: dict[str, Any] = {"caching": caching, "turn": n}
            for arm in ARMS:
                mine = [r for r in results if (r.caching, r.turn, r.arm) == (caching, n, arm)]
                row[f"{arm}_ttft_s"] = statistics.median(r.ttft_s for r in mine)
                row[f"{arm}_cached"] = statistics.fmean(r.cached_tokens / r.input_tokens for r in mine)
                row[f"{arm}_request_bytes"] = statistics.median(r.request_bytes for r in mine)
                row["input_tokens"] = statistics.median(r.input_tokens for r in mine)
            row["ratio"] = row["chained_ttft_s"] / row["resent_ttft_s"]
            row["paired_ratio"] = statistics.median(_pair_ratios(results, caching, n))
            rows.append(row)
    return rows


def _pairs(results: Sequence[Turn], caching: bool) -> list[tuple[Turn, Turn]]:
    """(chained, resent) of the same repeat and turn: measured one right after the other."""
    by_key = {(r.repeat, r.turn, r.arm): r for r in results if r.caching == caching}
    return [(r, by_key[(r.repeat, r.turn, "resent")]) for r in results if r.caching == caching and r.arm == "chained"]


def _pair_ratios(results: Sequence[Turn], caching: bool, turn: int | None = None) -> list[float]:
    pairs = _pairs(results, caching)
    return [a.ttft_s / b.ttft_s for a, b in pairs if (a.turn == turn if turn is not None else a.turn > 1)]


def overall(results: Sequence[Turn]) -> list[dict[str, Any]]:
    """Per caching setting, over turns 2 and later: the median of the paired ratios, each arm's median TTFT, and
    whether every pair's prompts were the same number of tokens."""
    rows = []
    for caching in sorted({r.caching for r in results}, reverse=True):
        later = [r for r in results if r.caching == caching and r.turn > 1]
        rows.append(
            {
                "caching": caching,
                "paired_ratio": statistics.median(_pair_ratios(results, caching)),
                "chained_ttft_s": statistics.median(r.ttft_s for r in later if r.arm == "chained"),
                "resent_ttft_s": statistics.median(r.ttft_s for r in later if r.arm == "resent"),
                "same_prompts": all(a.input_tokens == b.input_tokens for a, b in _pairs(results, caching)),
            }
        )
    return rows


def markdown(rows: Sequence[dict[str, Any]], totals: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| prefix caching | turns 2+: chained TTFT | resent TTFT | paired chained / resent | same prompts |",
        "|---|---|---|---|---|",
    ]
    for t in totals:
        lines.append(
            f"| {'on' if t['caching'] else 'off'} | {t['chained_ttft_s'] * 1000:.0f} ms | "
            f"{t['resent_ttft_s'] * 1000:.0f} ms | {t['paired_ratio']:.2f} | {'yes' if t['same_prompts'] else 'no'} |"
        )
    lines += [
        "",
        "| prefix caching | turn | prompt tokens | chained TTFT | resent TTFT | paired chained / resent | cached "
        "(chained, resent) | request bytes (chained, resent) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {'on' if r['caching'] else 'off'} | {r['turn']} | {r['input_tokens']:.0f} | "
            f"{r['chained_ttft_s'] * 1000:.0f} ms | {r['resent_ttft_s'] * 1000:.0f} ms | {r['paired_ratio']:.2f} | "
            f"{r['chained_cached']:.0%}, {r['resent_cached']:.0%} | "
            f"{r['chained_request_bytes']:.0f}, {r['resent_request_bytes']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks responses", description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="conversations per arm and caching setting")
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--caching", default="on,off", help="prefix caching settings to run: on, off or both")
    parser.add_argument("--server-arg", action="append", default=[], help="one more flag for the server (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="a folder for result.json, report.md and the logs")
    args = parser.parse_args(argv)
    out = args.out or Path("/tmp/responses-bench")
    results: list[Turn] = []
    for setting in [s for s in args.caching.split(",") if s]:
        caching = {"on": True, "off": False}[setting]
        target = batchserve_target("responses", "continuous", ServerSettings(enable_prefix_caching=caching))
        launch = LaunchConfig((*target.argv, *args.server_arg), health_timeout_s=300)
        with ServerProcess(launch, out / f"server-caching-{setting}.log") as server:
            results += asyncio.run(run(server.base_url, caching, args.turns, args.repeats, args.max_output_tokens))
    rows, totals = summary(results), overall(results)
    table = markdown(rows, totals)
    print(table, end="")
    document = {
        "mode": "continuous",
        "turns": args.turns,
        "repeats": args.repeats,
        "max_output_tokens": args.max_output_tokens,
        "server_args": list(args.server_arg),
        "overall": totals,
        "summary": rows,
        "turns_measured": [asdict(r) for r in results],
    }
    write_json(out / "result.json", document)
    command = " ".join(["python -m benchmarks responses", *(argv or [])])
    (out / "report.md").write_text(f"# responses\n\n`{command}`\n\n{table}")
    return 0
