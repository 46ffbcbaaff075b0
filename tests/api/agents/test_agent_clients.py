"""Real agent clients run their tool loops unchanged against a live server, in both modes (issue 41).

Each test runs one program from clients/ (openai-agents, LangGraph, pydantic-ai, the anthropic SDK, the openai
SDK's Responses API, LiteLLM) in a subprocess against the shared server of its mode. A program's scenarios each
run a loop with a turn bound, so it ends whatever the 135M model says; every tool call's arguments must validate
against the tool's JSON schema, every response the server sent while it ran must be a 200, and the program must
have used the endpoints its library is meant to use. What the model answers is not checked."""

from __future__ import annotations

import pytest

from tests.api.agents.harness import RecordedServer, run_client

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
PROGRAMS = {
    "openai_agents_loop": {RESPONSES, CHAT},
    "langgraph_react": {CHAT},
    "pydantic_ai_agent": {CHAT},
    "anthropic_messages": {"/v1/messages", "/v1/messages/count_tokens"},
    "openai_responses": {RESPONSES},
    "litellm_tools": {CHAT},
}


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_agent_client(agent_server: RecordedServer, program: str) -> None:
    run = run_client(agent_server, program)
    print(run.stdout)  # each scenario's ending and tool-call count, shown with -rP or on failure
    problems = run.problems(PROGRAMS[program])
    assert not problems, "\n".join([f"{program}:", *problems, "--- stderr (tail) ---", run.stderr[-4000:]])
