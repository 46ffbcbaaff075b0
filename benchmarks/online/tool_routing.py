"""How well a model routes under `tool_choice` "auto", per tool-call parser: one server per parser, the tool-routing
set (benchmarks/online/tool_routing_cases.py) sent greedily through /v1/chat/completions, and each answer scored.

    python -m benchmarks tool-routing [--parsers hermes,smollm2,llama3_json,generic] [--out DIR]

A case is right when the answer takes the right branch (a call, or text) and, for a call, calls the expected tool
first with the expected arguments. Calls are always valid against the tool's schema (the lazy grammar sees to
that; every call is checked with jsonschema anyway). The parser with the best F1 of right calls (precision: right
calls among the answers that called; recall: right calls among the cases that need one) is the model's default:
accuracy alone would crown a model that never calls, which answers the no-tool cases right and fails every other.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.online.tool_routing_cases import CASES, TOOLS, Case
from benchmarks.peers.targets import ServerSettings, batchserve_target
from benchmarks.results_io.report import write_json

PARSERS = ("hermes", "smollm2", "llama3_json", "generic")
_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@dataclass(frozen=True)
class Answer:
    case: str
    kind: str
    called: list[str]  # the functions called, in order
    arguments_ok: bool  # the first call holds the expected arguments
    valid: bool  # every call's arguments parse and match its tool's schema
    right: bool
    content: str
    finish_reason: str
    seconds: float
    completion_tokens: int


def matches(expected: Any, actual: Any) -> bool:
    if isinstance(expected, str):
        return isinstance(actual, str) and expected.lower() in actual.lower()
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        return isinstance(actual, int | float) and float(actual) == float(expected)
    return bool(expected == actual)


def score(case: Case, body: dict[str, Any], seconds: float) -> Answer:
    choice = body["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    called = [call["function"]["name"] for call in calls]
    valid, first_arguments = True, {}
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call["function"]["arguments"])
            jsonschema.validate(arguments, _SCHEMAS[call["function"]["name"]])
        except (ValueError, KeyError, jsonschema.ValidationError):
            valid = False
            continue
        if i == 0:
            first_arguments = arguments
    arguments_ok = bool(calls) and all(matches(v, first_arguments.get(k)) for k, v in case.arguments.items())
    right = not calls if case.tool is None else bool(calls) and called[0] == case.tool and arguments_ok
    return Answer(
        case.name, case.kind, called, arguments_ok, valid, right, choice["message"].get("content") or "",
        choice["finish_reason"], seconds, body["usage"]["completion_tokens"],
    )  # fmt: skip


async def ask(client: httpx.AsyncClient, model: str, case: Case, max_tokens: int) -> Answer:
    body = {"model": model, "messages": case.messages, "tools": TOOLS, "temperature": 0, "max_tokens": max_tokens}
    start = time.monotonic()
    response = await client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return score(case, response.json(), time.monotonic() - start)


async def run_cases(base_url: str, cases: Sequence[Case], max_tokens: int, concurrency: int) -> list[Answer]:
    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await ask(client, model, cases[0], 4)  # warm-up: compiles the tools' grammar, caches the system prompt
        gate = asyncio.Semaphore(concurrency)

        async def one(case: Case) -> Answer:
            async with gate:
                return await ask(client, model, case, max_tokens)

        return list(await asyncio.gather(*(one(case) for case in cases)))


def summary(answers: Sequence[Answer]) -> dict[str, Any]:
    def rate(items: Sequence[Answer], test: Any) -> float:
        return sum(1 for a in items if test(a)) / len(items) if items else 0.0

    calls = [a for a in answers if a.kind == "call"]
    texts = [a for a in answers if a.kind != "call"]
    case_tool = {case.name: case.tool for case in CASES}
    right_calls = sum(1 for a in calls if a.right)
    precision = right_calls / max(1, sum(1 for a in answers if a.called))
    recall = right_calls / max(1, len(calls))
    return {
        "call_f1": 2 * precision * recall / (precision + recall) if right_calls else 0.0,
        "call_precision": precision,
        "right": rate(answers, lambda a: a.right),
        "decision": rate(answers, lambda a: bool(a.called) == (a.kind == "call")),
        "called_when_it_should": rate(calls, lambda a: bool(a.called)),
        "right_tool": rate(calls, lambda a: bool(a.called) and a.called[0] == case_tool[a.case]),
        "right_arguments": rate(calls, lambda a: a.right),
        "answered_when_it_should": rate(texts, lambda a: not a.called),
        "answered_after_a_result": rate([a for a in texts if a.kind == "after_result"], lambda a: not a.called),
        "valid_calls": rate([a for a in answers if a.called], lambda a: a.valid),
        "median_seconds": statistics.median(a.seconds for a in answers),
        "mean_completion_tokens": statistics.mean(a.completion_tokens for a in answers),
    }


_COLUMNS = (  # (title, key, format)
    ("call F1", "call_f1", "{:.2f}"),
    ("right calls among calls made", "call_precision", "{:.0%}"),
    ("right", "right", "{:.0%}"),
    ("call or text right", "decision", "{:.0%}"),
    ("called when it should", "called_when_it_should", "{:.0%}"),
    ("right tool", "right_tool", "{:.0%}"),
    ("right arguments", "right_arguments", "{:.0%}"),
    ("text when it should", "answered_when_it_should", "{:.0%}"),
    ("text after a result", "answered_after_a_result", "{:.0%}"),
    ("calls valid", "valid_calls", "{:.0%}"),
    ("median latency", "median_seconds", "{:.1f} s"),
    ("completion tokens", "mean_completion_tokens", "{:.0f}"),
)


def markdown(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| parser | " + " | ".join(title for title, _, _ in _COLUMNS) + " |", "|---" * (len(_COLUMNS) + 1) + "|"]
    for parser, s in results.items():
        rows.append(f"| {parser} | " + " | ".join(spec.format(s[key]) for _, key, spec in _COLUMNS) + " |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks tool-routing", description=__doc__.split("\n")[0])
    parser.add_argument("--parsers", default=",".join(PARSERS), help="comma-separated tool-call parsers to compare")
    parser.add_argument("--max-tokens", type=int, default=64, help="per answer; a call of this set needs about 30")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (the server's seats)")
    parser.add_argument("--model", default=None, help="the server's --model (default: its default model)")
    parser.add_argument("--device", default=None, help="the server's --device")
    parser.add_argument("--server-arg", action="append", default=[], help="one more flag for the server (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="a folder for result.json, report.md and the logs")
    args = parser.parse_args(argv)
    out = args.out or Path("/tmp/tool-routing")
    settings = ServerSettings(seats=args.concurrency, model=args.model, device=args.device)
    results: dict[str, dict[str, Any]] = {}
    answers: dict[str, list[dict[str, Any]]] = {}
    for name in args.parsers.split(","):
        target = batchserve_target(f"tool-routing-{name}", "continuous", settings)
        target = dataclasses.replace(target, argv=(*target.argv, "--tool-call-parser", name, *args.server_arg))
        with ServerProcess(target.launch(LaunchConfig(target.argv, health_timeout_s=600)), out / f"{name}.log") as s:
            found = asyncio.run(run_cases(s.base_url, CASES, args.max_tokens, args.concurrency))
        results[name] = summary(found)
        answers[name] = [asdict(a) for a in found]
        print(json.dumps({name: results[name]}), flush=True)
    table = markdown(results)
    print(table, end="")
    best = max(results, key=lambda name: (results[name]["call_f1"], results[name]["right"]))
    document = {"settings": vars(args) | {"out": str(out)}, "results": results, "best": best, "answers": answers}
    write_json(out / "result.json", document)
    command = f"python -m benchmarks tool-routing {' '.join(argv or [])}".strip()
    (out / "report.md").write_text(f"# tool-routing\n\n`{command}`\n\n{table}\nBest: `{best}`.\n")
    return 0
