"""Grammar compiles cannot starve the server: a spec over its cost budget is a 400 naming the field and the flag
before anything compiles; a compile runs in a worker process that is killed past its deadline, when its client
leaves, or when the server shuts down; too many at once get a 429; a grammar with no answer is refused at compile.
Through live servers (uvicorn, the tiny model) and the real xgrammar in real worker processes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("xgrammar")

from api.protocol.errors import APIError
from api.structured.budget import budget_problem
from api.structured.grammars import CompileWorkers, build_grammars
from api.structured.limits import GrammarLimits
from api.structured.spec import GrammarKind, GrammarSpec
from tests.server_harness import RunningServer, mode_config, running_server, tiny_tokenizer, wait_until

PROMPT = "the quick brown fox"
WORKER = "api.structured.compile_worker"


def slow_pattern(tag: str, repeat: int = 20_000) -> dict[str, Any]:
    """A 50-byte schema that takes xgrammar tens of seconds of a core (the issue's hostile input)."""
    return {"type": "string", "pattern": f"^{tag}[a-z]{{1,{repeat}}}$"}


def ref_chain(length: int) -> dict[str, Any]:
    """`$ref`s chained through `length` definitions, each at depth 1 (the schema nests only two levels)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested(keyword: str, depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", keyword: schema}
    return schema


def worker_pids(server: RunningServer) -> set[int]:
    return set(server.runtime.grammars.worker_pids())


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()  # a killed worker is reaped, so it does not linger as a zombie


def post(server: RunningServer, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT, **body}, timeout=timeout)


@pytest.fixture(scope="module")
def default_server() -> Iterator[RunningServer]:
    with running_server(mode_config("continuous")) as server:
        yield server


@pytest.fixture(scope="module")
def deadline_server() -> Iterator[RunningServer]:
    """Budget wide open, so hostile specs really compile: what stops them is the deadline and the pool."""
    config = mode_config("continuous", grammar_max_repeat=100_000, grammar_compile_timeout_s=2.0, grammar_max_pending=2)
    with running_server(config) as server:
        yield server


BUDGET_CASES = {
    "pattern": ({"guided_json": slow_pattern("q1", 10_000)}, "guided_json", "--grammar-max-repeat"),
    "regex": ({"guided_regex": "q[a-z]{2,5000}"}, "guided_regex", "--grammar-max-repeat"),
    "ebnf": ({"guided_grammar": 'root ::= [a-z]{1,5000} "!"'}, "guided_grammar", "--grammar-max-repeat"),
    "pattern-properties": (
        {"structured_outputs": {"json": {"type": "object", "patternProperties": {"^a{1,3000}$": {}}}}},
        "structured_outputs",
        "--grammar-max-repeat",
    ),
    "ref-chain": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(1000)}}},
        "response_format",
        "--grammar-max-refs",
    ),
    "unevaluated-items": ({"guided_json": nested("unevaluatedItems", 150)}, "guided_json", "--grammar-max-depth"),
    "remote-ref": (
        {"guided_json": {"$ref": "http://example.com/s.json"}},
        "guided_json",
        "'http://example.com/s.json'",
    ),
}


@pytest.mark.parametrize(("body", "param", "named"), BUDGET_CASES.values(), ids=BUDGET_CASES.keys())
def test_a_spec_over_its_budget_is_a_400_naming_the_field_and_the_limit_before_it_compiles(
    default_server: RunningServer, body: dict[str, Any], param: str, named: str
) -> None:
    before = worker_pids(default_server)
    response = post(default_server, {"max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"], error
    assert worker_pids(default_server) == before  # refused before any compile: no worker was started for it


def test_a_schema_past_the_size_limit_names_the_flag() -> None:
    limits = GrammarLimits(max_bytes=100)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"enum": ["x" * 200]}), "guided_json")
    problem = budget_problem(spec, limits)
    assert problem is not None and "--grammar-max-bytes" in problem and "100" in problem
    assert (
        budget_problem(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"enum": ["x"]}), "guided_json"), limits) is None
    )


NO_ANSWER = {
    "left-recursion": {"guided_grammar": 'root ::= root "a"'},
    "empty-class": {"guided_regex": r"[^\s\S]"},
    "self-reference": {"guided_json": {"allOf": [{"$ref": "#"}]}},
}


@pytest.mark.parametrize("body", NO_ANSWER.values(), ids=NO_ANSWER.keys())
def test_a_grammar_that_admits_no_answer_is_refused_at_compile(default_server: RunningServer, body: dict) -> None:
    response = post(default_server, {"max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == next(iter(body)) and "admits no answer" in error["message"], error


@pytest.mark.slow
def test_a_compile_past_its_deadline_is_killed_and_refused_and_the_next_compiles(
    deadline_server: RunningServer,
) -> None:
    assert post(deadline_server, {"max_tokens": 2, "guided_regex": "[ab]"}).status_code == 200  # a worker runs
    (running,) = worker_pids(deadline_server)
    response = post(deadline_server, {"max_tokens": 2, "guided_json": slow_pattern("deadline")})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_json" and "--grammar-compile-timeout-s" in error["message"], error
    assert not alive(running)  # killed, not left compiling
    assert post(deadline_server, {"max_tokens": 2, "guided_regex": "[cd]"}).status_code == 200


def test_a_client_that_leaves_stops_its_compile(deadline_server: RunningServer) -> None:
    assert post(deadline_server, {"max_tokens": 2, "guided_regex": "[ef]"}).status_code == 200
    (running,) = worker_pids(deadline_server)
    with pytest.raises(httpx.ReadTimeout):
        post(deadline_server, {"max_tokens": 2, "guided_json": slow_pattern("leaves")}, timeout=0.5)
    # Well before the 2 s deadline would have ended it (the worker is replaced by a fresh one).
    wait_until(lambda: not alive(running), "the abandoned compile's worker was killed", timeout_s=1.5)


@pytest.mark.slow
def test_compiles_beyond_the_pending_limit_get_a_429(deadline_server: RunningServer) -> None:
    bodies = [{"max_tokens": 2, "guided_json": slow_pattern(f"busy{i}")} for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        futures = []
        for body in bodies:
            futures.append(pool.submit(post, deadline_server, body))
            time.sleep(0.2)  # in order: the first two are taken, the third finds the line full
        statuses = [f.result() for f in futures]
    assert [r.status_code for r in statuses] == [400, 400, 429], [r.text for r in statuses]
    busy = statuses[2]
    assert busy.headers["Retry-After"] and "--grammar-max-pending" in busy.json()["error"]["message"]


@pytest.mark.slow
def test_plain_and_cached_requests_beside_hostile_compiles_get_their_answers(deadline_server: RunningServer) -> None:
    plain = {"max_tokens": 12, "temperature": 0}
    cached = {"max_tokens": 2, "temperature": 0, "guided_regex": "[ab]"}  # compiled by an earlier test
    alone = post(deadline_server, plain).json()["choices"][0]["text"]
    with ThreadPoolExecutor(4) as pool:
        hostile = [pool.submit(post, deadline_server, {"max_tokens": 2, "guided_json": slow_pattern(f"h{i}")})
                   for i in range(2)]  # fmt: skip
        time.sleep(0.3)
        beside = post(deadline_server, plain).json()["choices"][0]["text"]
        constrained = post(deadline_server, cached)
        assert {f.result().status_code for f in hostile} == {400}
    assert beside == alone
    assert constrained.status_code == 200 and constrained.json()["choices"][0]["text"] in ("a", "b")


def test_closing_fails_a_waiting_compile_at_once_and_kills_the_worker() -> None:
    tokenizer = tiny_tokenizer()
    limits = GrammarLimits(max_repeat=100_000, compile_timeout_s=600)
    grammars = build_grammars(tokenizer, len(tokenizer), (int(tokenizer.eos_token_id),), limits)
    assert grammars is not None

    async def run() -> APIError:
        compile = asyncio.ensure_future(grammars.compile(GrammarSpec(GrammarKind.REGEX, "x[a-z]{1,30000}", "r")))
        while not grammars.worker_pids():  # the compile's worker is starting
            await asyncio.sleep(0.05)
        (running,) = grammars.worker_pids()
        await asyncio.sleep(0.5)
        grammars.close()
        with pytest.raises(APIError) as refused:
            await compile
        assert not alive(running)
        return refused.value

    error = asyncio.run(run())
    assert error.status == 503 and "shutting down" in error.message


def test_servers_sharing_compile_workers_start_one_and_a_closing_one_ends_only_its_own_compile() -> None:
    tokenizer = tiny_tokenizer()
    limits = GrammarLimits(max_repeat=100_000, compile_timeout_s=600)
    shared = CompileWorkers()
    first, second = (
        build_grammars(tokenizer, len(tokenizer), (int(tokenizer.eos_token_id),), limits, shared) for _ in range(2)
    )
    assert first is not None and second is not None

    async def run() -> APIError:
        await first.compile(GrammarSpec(GrammarKind.REGEX, "[ab]", "r"))
        (started,) = first.worker_pids()
        assert second.worker_pids() == [started]  # one pool: the second server starts no worker of its own
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(slow_pattern("shared")), "guided_json")
        hostile = asyncio.ensure_future(first.compile(spec))
        await asyncio.sleep(0.5)  # compiling on the one worker (it would take tens of seconds)
        first.close()  # the first server shuts down: its compile is ended, the pool goes on for the second
        with pytest.raises(APIError) as refused:
            await hostile
        wait_until(lambda: not alive(started), "the ended compile's worker to be killed")
        assert (await second.compile(GrammarSpec(GrammarKind.REGEX, "[cd]", "r"))) is not None  # on a new worker
        with pytest.raises(APIError):
            await first.compile(GrammarSpec(GrammarKind.REGEX, "[ef]", "r"))
        return refused.value

    try:
        error = asyncio.run(run())
    finally:
        shared.close()
    assert error.status == 503 and "shutting down" in error.message
    assert first.worker_pids() == [] and second.worker_pids() == []  # the owner's close kills them
