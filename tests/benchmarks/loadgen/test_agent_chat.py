"""The agent workload's chat side: the history a later turn resends, and streamed tool calls put back together."""

from __future__ import annotations

from benchmarks.loadgen.agent_chat import ToolCallDeltas, chat_payload, next_turn
from benchmarks.loadgen.workloads import RequestSpec, WorkloadConfig, build_workload


def _conversation() -> list[RequestSpec]:
    return build_workload(WorkloadConfig(name="agent", num_prompts=3, turns=3, system_prompt_words=8))


def test_a_turn_that_called_tools_gets_one_result_per_call_after_its_answer() -> None:
    first, second, _ = _conversation()
    calls = (
        {"id": "call-a", "type": "function", "function": {"name": "x", "arguments": "{}"}},
        {"id": "call-b", "type": "function", "function": {"name": "y", "arguments": '{"q": 1}'}},
    )
    turn = next_turn(first, "", calls, second)
    assert turn.chat is not None and first.chat is not None
    messages = turn.chat.messages
    assert messages[: len(first.chat.messages)] == first.chat.messages  # the history, resent whole
    assert messages[2] == {"role": "assistant", "content": None, "tool_calls": list(calls)}
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in messages[3:]] == [
        ("tool", "call-a", second.chat.reply),  # type: ignore[union-attr]
        ("tool", "call-b", second.chat.reply),  # type: ignore[union-attr]
    ]


def test_a_turn_that_answered_in_text_gets_a_user_message_and_the_history_keeps_growing() -> None:
    first, second, third = _conversation()
    turn2 = next_turn(first, "an answer", (), second)
    turn3 = next_turn(turn2, "another", (), third)
    assert turn3.chat is not None and turn2.chat is not None
    assert turn3.chat.messages[: len(turn2.chat.messages)] == turn2.chat.messages
    assert turn3.chat.messages[-2:] == (
        {"role": "assistant", "content": "another"},
        {"role": "user", "content": third.chat.reply},  # type: ignore[union-attr]
    )
    payload = chat_payload(turn3.chat, turn3.max_tokens)
    assert set(payload) == {"messages", "tools", "max_tokens"}  # no tool_choice: auto, as agents send it


def test_streamed_tool_calls_reassemble_by_index_with_arguments_appended() -> None:
    deltas = ToolCallDeltas()
    assert deltas.add([{"index": 0, "id": "c0", "type": "function", "function": {"name": "get", "arguments": ""}}])
    assert deltas.add([{"index": 1, "id": "c1", "type": "function", "function": {"name": "put", "arguments": '{"a'}}])
    both = [{"index": 0, "function": {"arguments": '{"q": '}}, {"index": 1, "function": {"arguments": '": 2}'}}]
    assert deltas.add(both)
    assert deltas.add([{"index": 0, "function": {"arguments": "1}"}}])
    assert not deltas.add([])
    assert deltas.calls() == (
        {"id": "c0", "type": "function", "function": {"name": "get", "arguments": '{"q": 1}'}},
        {"id": "c1", "type": "function", "function": {"name": "put", "arguments": '{"a": 2}'}},
    )
