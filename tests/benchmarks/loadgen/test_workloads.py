"""Workloads: same seed, same requests; each shaped as documented."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from benchmarks.loadgen.workloads import WORKLOADS, WorkloadConfig, build_workload


@pytest.mark.parametrize("name", [w for w in WORKLOADS if w != "jsonl"])
def test_same_seed_reproduces_different_seed_changes(name: str) -> None:
    a = build_workload(WorkloadConfig(name=name, num_prompts=40, seed=1))
    assert a == build_workload(WorkloadConfig(name=name, num_prompts=40, seed=1))
    assert a != build_workload(WorkloadConfig(name=name, num_prompts=40, seed=2))
    assert [s.index for s in a] == list(range(40))
    assert len({s.prompt for s in a}) == 40  # no accidental shared prefixes


def test_mixed_is_three_quarters_short_one_quarter_long() -> None:
    specs = build_workload(WorkloadConfig(name="mixed", num_prompts=48, seed=0))
    short = [s for s in specs if s.kind == "short"]
    long = [s for s in specs if s.kind == "long"]
    assert (len(short), len(long)) == (36, 12)
    assert all(s.max_tokens == 16 for s in short)
    assert all(128 <= s.max_tokens <= 256 for s in long)
    assert all(16 <= s.prompt_tokens <= 64 for s in specs)
    assert all(len(s.prompt.split()) == s.prompt_tokens for s in specs)
    # The long requests are spread through the run, not bunched at one end.
    long_positions = [s.index for s in long]
    assert min(long_positions) < 24 <= max(long_positions)


def test_grounded_prompts_hold_the_passage_their_answer_repeats() -> None:
    specs = build_workload(WorkloadConfig(name="grounded", num_prompts=30, seed=3))
    assert [s.kind for s in specs[:3]] == ["quote", "edit", "summary"]
    for spec in specs:
        passage = spec.prompt.split("\n\n")[0].removeprefix("Passage: ")
        assert 64 <= len(passage.split()) <= 192 and spec.prompt_tokens == len(spec.prompt.split())
        # Quotes and edits answer with the whole passage, summaries with a quarter: long grounded answers.
        expected = len(passage.split()) // (4 if spec.kind == "summary" else 1)
        assert spec.max_tokens == expected
        if spec.kind == "edit":
            assert f"every '{passage.split()[0]}' replaced by" in spec.prompt
    with pytest.raises(ValueError, match="grounded_words"):
        WorkloadConfig(name="grounded", grounded_words_min=10, grounded_words_max=5)


def test_grounded_chat_asks_about_prose_and_code_it_sends() -> None:
    specs = build_workload(WorkloadConfig(name="grounded-chat", num_prompts=16, seed=5))
    assert [s.kind for s in specs[:4]] == ["quote", "edit", "summary", "code"]
    for spec in specs:
        assert spec.chat is not None and spec.chat.tools == ()
        (message,) = spec.chat.messages
        assert message == {"role": "user", "content": spec.prompt}
        task, body = spec.prompt.split("\n\n", 1)
        if spec.kind == "code":
            code = body.removeprefix("```python\n").removesuffix("```")
            tree = ast.parse(code)  # well-formed Python
            (definition,) = tree.body
            assert isinstance(definition, ast.FunctionDef) and f"the function {definition.name} to" in task
        else:
            sentences = body.split(". ")
            assert len(body.split()) >= 64 and all(s[0].isupper() for s in sentences)
            words = len(body.split())
            assert spec.max_tokens == (words // 2 if spec.kind == "summary" else 2 * words)
            if spec.kind == "edit":
                assert task.split("'")[1] in body.split()


def test_uniform_has_equal_lengths() -> None:
    specs = build_workload(WorkloadConfig(name="uniform", num_prompts=10, input_len=32, output_len=20))
    assert {len(s.prompt.split()) for s in specs} == {32}
    assert {s.max_tokens for s in specs} == {20}


def test_long_prompt_has_a_few_long_prompts_among_short_ones() -> None:
    specs = build_workload(WorkloadConfig(name="long-prompt", num_prompts=40, seed=4))
    long = [s for s in specs if s.kind == "long"]
    assert len(long) == 5
    assert all(384 <= len(s.prompt.split()) <= 768 for s in long)
    assert all(len(s.prompt.split()) <= 64 for s in specs if s.kind == "short")
    tiny = build_workload(WorkloadConfig(name="long-prompt", num_prompts=2))
    assert any(s.kind == "long" for s in tiny)  # a small run still has one


def test_jsonl_reads_prompts_and_cycles(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [{"prompt": "hello there", "max_tokens": 5}, {"prompt": "a b c", "max_tokens": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = build_workload(WorkloadConfig(name="jsonl", num_prompts=5, jsonl_path=str(path)))
    assert [s.prompt for s in specs] == ["hello there", "a b c"] * 2 + ["hello there"]
    assert [s.max_tokens for s in specs] == [5, 9, 5, 9, 5]


def test_jsonl_rejects_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="max_tokens"):
        build_workload(WorkloadConfig(name="jsonl", num_prompts=1, jsonl_path=str(path)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "nope"}, "workload must be one of"),
        ({"num_prompts": 0}, "num_prompts must be >= 1"),
        ({"name": "jsonl"}, "the jsonl workload needs jsonl_path"),
        ({"long_fraction": 1.5}, r"long_fraction must be in \[0, 1\]"),
        ({"long_output_min": 300, "long_output_max": 200}, "long_output range must satisfy"),
        ({"output_len": 0}, "output_len must be >= 1"),
    ],
)
def test_invalid_configs_are_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


def test_multi_turn_conversations_share_one_system_prompt_and_chain_their_turns() -> None:
    specs = build_workload(WorkloadConfig(name="multi-turn", num_prompts=10, turns=4, system_prompt_words=32))
    firsts = [s for s in specs if s.follows is None]
    assert [s.index for s in firsts] == [0, 4, 8]  # conversations of 4, 4 and 2 turns
    system = firsts[0].prompt.split("\nUser:")[0]
    assert all(s.prompt.startswith(system) and s.kind == "first-turn" for s in firsts)
    for spec in specs:
        if spec.follows is not None:
            assert spec.follows == spec.index - 1 and spec.kind == "later-turn"
            assert spec.prompt.startswith("\nUser:") and spec.prompt.endswith("\nAssistant:")
            assert spec.prompt_tokens > specs[spec.follows].prompt_tokens  # the history grows
    assert build_workload(WorkloadConfig(name="multi-turn", num_prompts=10, turns=4, system_prompt_words=32)) == specs
    assert all(16 <= s.max_tokens <= 64 for s in specs) and len({s.max_tokens for s in specs}) > 1  # no lockstep


def test_shared_prefix_groups_interleave_questions_over_long_prefixes() -> None:
    specs = build_workload(WorkloadConfig(name="shared-prefix", num_prompts=8, prefix_groups=2, prefix_words=64))
    prefixes = [s.prompt.split("\nQuestion:")[0] for s in specs]
    assert len(set(prefixes)) == 2 and prefixes[0] == prefixes[2] != prefixes[1]
    assert len(prefixes[0].split()) == 64 and all(s.follows is None for s in specs)
    assert len({s.prompt for s in specs}) == 8


def test_agent_conversations_share_one_system_prompt_and_tool_set_and_answer_each_turn() -> None:
    config = WorkloadConfig(name="agent", num_prompts=10, turns=4, system_prompt_words=64, agent_tools=3)
    specs = build_workload(config)
    chats = [s.chat for s in specs]
    assert all(chat is not None for chat in chats)
    firsts = [s for s in specs if s.follows is None]
    assert [s.index for s in firsts] == [0, 4, 8]  # 10 requests: conversations of 4, 4 and 2 turns
    assert {s.kind for s in firsts} == {"agent-task"}
    systems = {json.dumps(s.chat.messages[0]) for s in firsts if s.chat is not None}
    assert len(systems) == 1 and len(next(iter(systems)).split()) > 64  # one long system prompt for all
    tools = {json.dumps(chat.tools) for chat in chats if chat is not None}
    assert len(tools) == 1  # one tool set, offered on every turn
    tool_set = json.loads(next(iter(tools)))
    assert len(tool_set) == 3 and all(t["function"]["parameters"]["required"] == ["query"] for t in tool_set)
    for spec in specs:
        if spec.follows is not None:
            assert spec.follows == spec.index - 1 and spec.kind == "agent-turn"
            assert spec.chat is not None and spec.chat.reply and spec.chat.messages == ()
            assert spec.prompt_tokens > specs[spec.follows].prompt_tokens  # the history grows
