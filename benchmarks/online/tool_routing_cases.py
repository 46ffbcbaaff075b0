"""The tool-routing set: five tools, and conversations that should call one of them (with the arguments a right call
holds), that should not (small talk, writing, translation), and that just got a tool's result and should answer.

Small on purpose: it asks whether a model picks the right branch of `tool_choice` "auto" (call or answer), the
right tool and the obvious arguments, not how well it reasons.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [
    _function(
        "get_weather",
        "Get the current weather in a city",
        {"city": {"type": "string", "description": "The city, e.g. Paris"}},
        ["city"],
    ),
    _function("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]),
    _function(
        "send_email",
        "Send an email",
        {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        ["to", "subject", "body"],
    ),
    _function("search_web", "Search the web", {"query": {"type": "string"}}, ["query"]),
    _function(
        "get_time",
        "Get the current time in a place",
        {"place": {"type": "string", "description": "A city or time zone"}},
        ["place"],
    ),
]


@dataclass(frozen=True)
class Case:
    """`tool`: the function a right answer calls first (None: it calls none); `arguments`: values its call must
    hold (a string matches when it contains the expected text, any case)."""

    name: str
    messages: list[dict[str, Any]]
    tool: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    kind: str = "call"  # call, answer (no tool fits), after_result (a tool's result came back: answer it)


def _ask(name: str, text: str, tool: str | None = None, **arguments: Any) -> Case:
    return Case(name, [{"role": "user", "content": text}], tool, arguments, "call" if tool else "answer")


def _after(name: str, question: str, tool: str, arguments: dict[str, Any], result: str) -> Case:
    call = {"id": f"call_{name}", "type": "function", "function": {"name": tool, "arguments": json.dumps(arguments)}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{name}", "content": result},
    ]
    return Case(name, messages, None, {}, "after_result")


CASES = [
    _ask("weather-paris", "What's the weather like in Paris right now?", "get_weather", city="Paris"),
    _ask("weather-london", "Is it raining in London today?", "get_weather", city="London"),
    _ask("weather-tokyo", "Tell me the temperature in Tokyo.", "get_weather", city="Tokyo"),
    _ask("weather-berlin", "Weather forecast for Berlin, please.", "get_weather", city="Berlin"),
    _ask("weather-rome", "Can you check the weather in Rome?", "get_weather", city="Rome"),
    _ask("add-12-30", "What is 12 plus 30?", "add", a=12, b=30),
    _ask("add-7-5", "Add 7 and 5.", "add", a=7, b=5),
    _ask("add-100-250", "Please compute the sum of 100 and 250.", "add", a=100, b=250),
    _ask("add-45-55", "I need the sum of 45 and 55.", "add", a=45, b=55),
    _ask("email-bob", "Send an email to bob@example.com saying the meeting moved to 3pm.", "send_email",
         to="bob@example.com"),
    _ask("email-alice", "Email alice@example.com with the subject 'Lunch' to ask if she is free tomorrow.",
         "send_email", to="alice@example.com", subject="lunch"),
    _ask("email-carol", "Write an email to carol@example.com telling her the report is ready.", "send_email",
         to="carol@example.com"),
    _ask("search-cars", "Search the web for the latest news about electric cars.", "search_web",
         query="electric car"),
    _ask("search-worldcup", "Look up online who won the 2022 World Cup.", "search_web", query="world cup"),
    _ask("search-canada", "Search the web for the population of Canada.", "search_web", query="canada"),
    _ask("time-newyork", "What time is it in New York?", "get_time", place="new york"),
    _ask("time-tokyo", "Current time in Tokyo, please.", "get_time", place="tokyo"),
    _ask("time-sydney", "Get me the time in Sydney.", "get_time", place="sydney"),
    _ask("haiku", "Write a haiku about the sea."),
    _ask("hello", "Hello! How are you today?"),
    _ask("translate", "Translate 'thank you' into French."),
    _ask("octopus", "Tell me a fun fact about octopuses."),
    _ask("sleep", "Give me three tips for better sleep."),
    _ask("poem", "Write a short poem about autumn leaves."),
    _ask("thanks", "Thanks, that's all I needed!"),
    _ask("noun", "Explain what a noun is in one sentence."),
    _after("paris-result", "What's the weather in Paris?", "get_weather", {"city": "Paris"},
           '{"temperature_c": 18, "sky": "sunny"}'),
    _after("add-result", "What is 12 plus 30?", "add", {"a": 12, "b": 30}, "42"),
    _after("email-result", "Email bob@example.com that I'm late.", "send_email",
           {"to": "bob@example.com", "subject": "Late", "body": "I'm running late."}, '{"status": "sent"}'),
    _after("time-result", "What time is it in Tokyo?", "get_time", {"place": "Tokyo"}, "21:04"),
]  # fmt: skip
