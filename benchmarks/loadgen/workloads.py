"""Seeded, reproducible request sets: what to ask the server, not when.

Prompts are strings of common English words; with a BPE tokenizer each is about one token (a leading space
plus a frequent word), so `prompt_tokens` is an estimate. Output length is set by `max_tokens`; with
`ignore_eos` the server generates exactly that many.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.loadgen.passages import function, passage

WORKLOADS = (
    "mixed", "uniform", "long-prompt", "multi-turn", "shared-prefix", "agent", "grounded", "grounded-chat", "jsonl",
)  # fmt: skip

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or has had "
    "not their first one new also after two its who but been they more other when time there city three into "
    "year school most over some world only years him during may where made since many while later about "
    "would between known part team such used well state can before around both being under through early "
    "then four several day she these same found until best second without however people each named game "
    "water house music light river small great large north south east west high life long good work name "
    "home line side place group power order point system story field night word paper money market family "
    "table road stone garden window morning summer winter spring autumn village forest island "
    "mountain valley bridge"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class ChatTurn:
    """A chat request's part of an agent conversation. A first turn carries its messages (the system prompt and the
    task); a later turn carries `reply`, which answers the previous turn: each of its tool calls' result, or a user
    message when it called none. The client sends the whole history with `tools` and no tool_choice (auto)."""

    tools: tuple[dict[str, Any], ...]
    messages: tuple[dict[str, Any], ...] = ()
    reply: str = ""


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str
    max_tokens: int
    prompt_tokens: int  # estimate; the server's usage.prompt_tokens is the truth when it reports it
    kind: str  # which part of the workload this came from, e.g. "short" or "long"
    # A conversation's later turn: sent once request `follows` has finished, its prompt being that request's
    # prompt, then its answer, then `prompt` (the new message). None: sent at its own arrival time.
    follows: int | None = None
    # vLLM's `priority` field (lower first, for a server under --scheduling-policy priority); 0 is not sent
    priority: int = 0
    # A prefix shared with other requests: (its name, its tokens, estimated), for the simulator's prefix cache.
    prefix: tuple[str, int] | None = None
    # A chat request (/v1/chat/completions with tools) instead of a completion of `prompt`: the agent workload.
    chat: ChatTurn | None = None


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "mixed"
    num_prompts: int = 48
    seed: int = 0
    # mixed: most requests short, a fraction with long outputs
    short_output: int = 16
    long_output_min: int = 128
    long_output_max: int = 256
    long_fraction: float = 0.25
    short_prompt_min: int = 16
    short_prompt_max: int = 64
    # uniform
    input_len: int = 64
    output_len: int = 64
    # long-prompt: a few prompts of several hundred tokens among short ones
    long_prompt_min: int = 384
    long_prompt_max: int = 768
    long_prompt_fraction: float = 0.125
    long_prompt_output: int = 32
    # multi-turn: conversations that re-send their history (system prompt, messages, answers) every turn
    turns: int = 4
    system_prompt_words: int = 256  # one system prompt shared by every conversation
    # tokens of each answer, drawn per turn (equal lengths would keep every conversation in lockstep, all
    # turns arriving at once); the messages are short_prompt_min..max words
    turn_output_min: int = 16
    turn_output_max: int = 64
    # shared-prefix: groups of prompts over a long common prefix (a document, few-shot examples)
    prefix_groups: int = 4
    prefix_words: int = 512
    prefix_output: int = 32  # the questions after the prefix are short_prompt_min..max words
    # agent: chat conversations of `turns` turns over tools and a system prompt of system_prompt_words, each turn
    # answering the last (tool results, or a user message), at most agent_max_tokens each
    agent_tools: int = 4
    agent_max_tokens: int = 64
    # grounded: a passage in the prompt to quote, edit or summarise, so the answer repeats the prompt (what n-gram
    # speculation drafts from); quotes and edits answer with the passage's length, summaries with a quarter of it
    grounded_words_min: int = 64
    grounded_words_max: int = 192
    # jsonl
    jsonl_path: str | None = None

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.name == "jsonl" and not self.jsonl_path:
            raise ValueError("the jsonl workload needs jsonl_path")
        for low, high, what in (
            (self.long_output_min, self.long_output_max, "long_output"),
            (self.short_prompt_min, self.short_prompt_max, "short_prompt"),
            (self.long_prompt_min, self.long_prompt_max, "long_prompt"),
            (self.turn_output_min, self.turn_output_max, "turn_output"),
            (self.grounded_words_min, self.grounded_words_max, "grounded_words"),
        ):
            if not 1 <= low <= high:
                raise ValueError(f"{what} range must satisfy 1 <= min <= max, got {low}..{high}")
        for value, what in (
            (self.short_output, "short_output"),
            (self.input_len, "input_len"),
            (self.output_len, "output_len"),
            (self.long_prompt_output, "long_prompt_output"),
            (self.turns, "turns"),
            (self.system_prompt_words, "system_prompt_words"),
            (self.prefix_groups, "prefix_groups"),
            (self.prefix_words, "prefix_words"),
            (self.prefix_output, "prefix_output"),
            (self.agent_tools, "agent_tools"),
            (self.agent_max_tokens, "agent_max_tokens"),
        ):
            if value < 1:
                raise ValueError(f"{what} must be >= 1, got {value}")
        for frac, what in (
            (self.long_fraction, "long_fraction"),
            (self.long_prompt_fraction, "long_prompt_fraction"),
        ):
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"{what} must be in [0, 1], got {frac}")


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    rng = np.random.default_rng(config.seed)
    if config.name == "mixed":
        return _mixed(config, rng)
    if config.name == "uniform":
        return _uniform(config, rng)
    if config.name == "long-prompt":
        return _long_prompt(config, rng)
    if config.name == "multi-turn":
        return _multi_turn(config, rng)
    if config.name == "shared-prefix":
        return _shared_prefix(config, rng)
    if config.name == "agent":
        return _agent(config, rng)
    if config.name == "grounded":
        return _grounded(config, rng)
    if config.name == "grounded-chat":
        return _grounded_chat(config, rng)
    return _from_jsonl(config)


def make_prompt(rng: np.random.Generator, num_words: int) -> str:
    words = rng.choice(len(_WORDS), size=num_words)
    return " ".join(_WORDS[i] for i in words)


def _pick_indices(rng: np.random.Generator, n: int, fraction: float) -> set[int]:
    # An exact count (not a coin flip per request) keeps the mix the same for every seed.
    count = round(n * fraction)
    return {int(i) for i in rng.permutation(n)[:count]}


def _short_prompt_len(config: WorkloadConfig, rng: np.random.Generator) -> int:
    return int(rng.integers(config.short_prompt_min, config.short_prompt_max + 1))


def _mixed(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    long_ids = _pick_indices(rng, config.num_prompts, config.long_fraction)
    specs = []
    for i in range(config.num_prompts):
        n_words = _short_prompt_len(config, rng)
        if i in long_ids:
            max_tokens, kind = int(rng.integers(config.long_output_min, config.long_output_max + 1)), "long"
        else:
            max_tokens, kind = config.short_output, "short"
        specs.append(RequestSpec(i, make_prompt(rng, n_words), max_tokens, n_words, kind))
    return specs


GROUNDED_KINDS = ("quote", "edit", "summary")


def _grounded(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    specs = []
    for i in range(config.num_prompts):
        n_words = int(rng.integers(config.grounded_words_min, config.grounded_words_max + 1))
        passage = make_prompt(rng, n_words)
        kind = GROUNDED_KINDS[i % len(GROUNDED_KINDS)]
        if kind == "quote":
            task, lead, max_tokens = "Quote the passage above exactly.", "Quote:", n_words
        elif kind == "edit":
            old, new = passage.split()[0], _WORDS[int(rng.integers(len(_WORDS)))]
            task, lead, max_tokens = (
                f"Rewrite the passage above with every '{old}' replaced by '{new}'.",
                "Rewritten:",
                n_words,
            )
        else:
            task, lead, max_tokens = (
                "Summarise the passage above, quoting its key phrases.",
                "Summary:",
                max(1, n_words // 4),
            )
        prompt = f"Passage: {passage}\n\n{task}\n{lead}"
        specs.append(RequestSpec(i, prompt, max_tokens, len(prompt.split()), kind))
    return specs


GROUNDED_CHAT_KINDS = ("quote", "edit", "summary", "code")
_EDIT_WORDS = ("harbour", "village", "tower", "garden", "meadow", "orchard", "workshop", "lantern")


def _grounded_chat(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    """What `grounded` asks, of plain-English passages (benchmarks/loadgen/passages.py) and short Python functions,
    as chat requests that end where the model ends them: a quote, an edit and a summary of a passage, and a
    function renamed. `max_tokens` only caps a runaway answer (twice the passage, a summary half of it)."""
    specs = []
    for i in range(config.num_prompts):
        kind = GROUNDED_CHAT_KINDS[i % len(GROUNDED_CHAT_KINDS)]
        if kind == "code":
            code, name = function(rng)
            new_name = f"{name}_{_WORDS[int(rng.integers(len(_WORDS)))]}"
            task = f"Rename the function {name} to {new_name} in the code below. Return the whole code."
            text = f"{task}\n\n```python\n{code}```"
            max_tokens = 2 * len(code.split()) + 64
        else:
            words = passage(rng, config.grounded_words_min, config.grounded_words_max)
            if kind == "quote":
                task, max_tokens = "Repeat the passage below exactly, word for word.", 2 * len(words.split())
            elif kind == "edit":
                old = next(w for w in words.split() if len(w) > 4 and w.isalpha())
                new = _EDIT_WORDS[int(rng.integers(len(_EDIT_WORDS)))]
                task, max_tokens = (
                    f"Rewrite the passage below with every '{old}' replaced by '{new}'.",
                    2 * len(words.split()),
                )
            else:
                task, max_tokens = "Summarise the passage below, quoting its key phrases.", len(words.split()) // 2
            text = f"{task}\n\n{words}"
        chat = ChatTurn(tools=(), messages=({"role": "user", "content": text},))
        specs.append(RequestSpec(i, text, max_tokens, len(text.split()), kind, chat=chat))
    return specs


def _uniform(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    return [
        RequestSpec(i, make_prompt(rng, config.input_len), config.output_len, config.input_len, "uniform")
        for i in range(config.num_prompts)
    ]


def _long_prompt(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    n_long = max(1, round(config.num_prompts * config.long_prompt_fraction))
    long_ids = {int(i) for i in rng.permutation(config.num_prompts)[:n_long]}
    specs = []
    for i in range(config.num_prompts):
        if i in long_ids:
            n_words, kind = int(rng.integers(config.long_prompt_min, config.long_prompt_max + 1)), "long"
        else:
            n_words, kind = _short_prompt_len(config, rng), "short"
        specs.append(RequestSpec(i, make_prompt(rng, n_words), config.long_prompt_output, n_words, kind))
    return specs


def _multi_turn(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    """num_prompts requests as conversations of `turns` turns (the last one may be shorter), each turn a user
    message after the whole history, as vLLM's multi-turn benchmark sends them. Conversation by conversation, so
    a conversation's first turn takes the next arrival time and its later turns follow its answers."""
    system = f"System: {make_prompt(rng, config.system_prompt_words)}"
    specs: list[RequestSpec] = []
    for index in range(config.num_prompts):
        turn = index % config.turns
        n_words = _short_prompt_len(config, rng)
        message = f"\nUser: {make_prompt(rng, n_words)}\nAssistant:"
        answer = int(rng.integers(config.turn_output_min, config.turn_output_max + 1))
        if turn == 0:
            tokens = config.system_prompt_words + n_words
            spec = RequestSpec(
                index, system + message, answer, tokens, "first-turn", prefix=("system", config.system_prompt_words)
            )
        else:
            history = specs[-1].prompt_tokens + specs[-1].max_tokens
            spec = RequestSpec(index, message, answer, history + n_words, "later-turn", follows=index - 1)
        specs.append(spec)
    return specs


def _shared_prefix(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    """Groups of questions over a long common prefix (SGLang's generated-shared-prefix), interleaved."""
    prefixes = [make_prompt(rng, config.prefix_words) for _ in range(config.prefix_groups)]
    specs = []
    for index in range(config.num_prompts):
        n_words = _short_prompt_len(config, rng)
        group = index % config.prefix_groups
        prompt = f"{prefixes[group]}\nQuestion: {make_prompt(rng, n_words)}\nAnswer:"
        tokens = config.prefix_words + n_words
        prefix = (f"group {group}", config.prefix_words)
        specs.append(RequestSpec(index, prompt, config.prefix_output, tokens, "shared-prefix", prefix=prefix))
    return specs


def _agent_tools(config: WorkloadConfig, rng: np.random.Generator) -> tuple[dict[str, Any], ...]:
    """Function tools as agents declare them: a name, a sentence, and an object of typed parameters."""
    tools = []
    for i in range(config.agent_tools):
        name = f"{_WORDS[int(rng.integers(len(_WORDS)))]}_{_WORDS[int(rng.integers(len(_WORDS)))]}_{i}"
        parameters = {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": make_prompt(rng, 8)},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            },
            "required": ["query"],
        }
        function = {"name": name, "description": make_prompt(rng, 16), "parameters": parameters}
        tools.append({"type": "function", "function": function})
    return tuple(tools)


def _agent(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    """num_prompts chat requests as agent conversations of `turns` turns: one long system prompt and one tool set
    shared by every conversation, a task, then turns that each answer the model's last turn with its tools' results
    (or a user message if it called none), the whole history resent each time as agents do. `prompt` holds the
    turn's own words (the task, or the reply), for the record; the request is `chat`."""
    tools = _agent_tools(config, rng)
    tool_words = sum(len(json.dumps(tool).split()) for tool in tools)
    system = {"role": "system", "content": f"You are an agent. {make_prompt(rng, config.system_prompt_words)}"}
    specs: list[RequestSpec] = []
    for index in range(config.num_prompts):
        turn = index % config.turns
        n_words = _short_prompt_len(config, rng)
        text = make_prompt(rng, n_words)
        if turn == 0:
            task = {"role": "user", "content": text}
            tokens = config.system_prompt_words + tool_words + n_words
            chat = ChatTurn(tools, messages=(system, task))
            spec = RequestSpec(
                index, text, config.agent_max_tokens, tokens, "agent-task", prefix=("system", tokens - n_words),
                chat=chat,
            )  # fmt: skip
        else:
            history = specs[-1].prompt_tokens + config.agent_max_tokens
            chat = ChatTurn(tools, reply=text)
            spec = RequestSpec(
                index, text, config.agent_max_tokens, history + n_words, "agent-turn", follows=index - 1, chat=chat
            )
        specs.append(spec)
    return specs


def _from_jsonl(config: WorkloadConfig) -> list[RequestSpec]:
    assert config.jsonl_path is not None
    rows = []
    for line_no, line in enumerate(Path(config.jsonl_path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt, max_tokens = row.get("prompt"), row.get("max_tokens")
        if not isinstance(prompt, str) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{config.jsonl_path}:{line_no}: need a string 'prompt' and a positive 'max_tokens'")
        rows.append((prompt, max_tokens))
    if not rows:
        raise ValueError(f"{config.jsonl_path} has no requests")
    # Cycle through the file so --num-prompts means the same thing for every workload.
    specs = []
    for i in range(config.num_prompts):
        prompt, max_tokens = rows[i % len(rows)]
        specs.append(RequestSpec(i, prompt, max_tokens, len(prompt.split()), "jsonl"))
    return specs
