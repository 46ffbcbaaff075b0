"""The tool-call parsers (api/structured/tool_parsers/): each format's calls read back from its own rendering, free
text as content, and the streamed events the same whatever pieces the answer arrives in. Pure text: no model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.structured.tool_parsers.base import CallArguments, CallStart, Content, Event, Parsed, ParsedCall, ToolParser
from api.structured.tool_parsers.registry import PARSERS, default_parser_name

NAMES = sorted(PARSERS)
_TEXT = st.characters(exclude_categories=["Cs"])
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-999, 999) | st.text(_TEXT, max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(_TEXT, max_size=4), inner, max_size=3),
    max_leaves=8,
)
_CALLS = st.lists(
    st.builds(
        ParsedCall,
        st.text(_TEXT, min_size=1, max_size=8),
        st.dictionaries(st.text(_TEXT, max_size=5), _JSON_VALUES, max_size=4).map(json.dumps),
    ),
    min_size=1,
    max_size=3,
)
# Free text with the characters formats are made of, so triggers are half-written and JSON is half-open.
_PIECES = [*'ab <>{}[]":;,\n\\_/|', "<tool_call>", "</tool_call>", '{"name": ', "<|python_tag|>", '{"response": ']
_FREE = st.lists(st.sampled_from(_PIECES), max_size=12).map("".join)


@dataclass
class Streamed:
    """What a client assembles from the events: content, and each announced call's name and arguments."""

    content: str = ""
    calls: list[list[str]] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Content):
                self.content += event.text
            elif isinstance(event, CallStart):
                assert event.index == len(self.calls)  # indices count up from 0, each announced once
                self.calls.append([event.name, ""])
            elif isinstance(event, CallArguments):
                assert event.index == len(self.calls) - 1  # only the latest call grows
                self.calls[event.index][1] += event.text


def streamed(parser: ToolParser, text: str, cuts: list[int]) -> tuple[Streamed, Parsed]:
    stream, out, position = parser.stream(), Streamed(), 0
    for cut in cuts:
        out.add(stream.feed(text[position : position + cut]))
        position += cut
    out.add(stream.feed(text[position:]))
    out.add(stream.finish())
    return out, stream.result()


def check_agrees(parser: ToolParser, text: str, cuts: list[int]) -> Parsed:
    """The streamed events and the whole-text parse agree, whatever the pieces."""
    whole = parser.parse(text)
    out, result = streamed(parser, text, cuts)
    assert result == whole
    assert out.content == whole.content
    assert [tuple(c) for c in out.calls[: len(whole.calls)]] == [(c.name, c.arguments) for c in whole.calls]
    # At most one call more was announced: the one the answer ended in, shown as `unfinished`.
    assert len(out.calls) - len(whole.calls) == (1 if whole.unfinished and len(out.calls) > len(whole.calls) else 0)
    return whole


@pytest.mark.parametrize("name", NAMES)
@given(calls=_CALLS, cuts=st.lists(st.integers(1, 7), max_size=60))
def test_rendered_calls_parse_back_whatever_the_pieces(name: str, calls: list[ParsedCall], cuts: list[int]) -> None:
    parser = PARSERS[name]
    whole = check_agrees(parser, parser.render_calls(calls), cuts)
    assert whole == Parsed("", tuple(calls))


@pytest.mark.parametrize("name", ["hermes", "smollm2", "llama3_json"])
@given(
    before=_FREE, calls=_CALLS, after=_FREE, cut_at=st.none() | st.integers(0, 400), cuts=st.lists(st.integers(1, 9))
)
@settings(max_examples=150)
def test_free_text_and_calls_agree_streamed_and_whole(name, before, calls, after, cut_at, cuts) -> None:
    """Free text, calls, free text, possibly cut anywhere (max_tokens or a stop string): the same either way."""
    parser = PARSERS[name]
    text = before + parser.render_calls(calls) + after
    check_agrees(parser, text if cut_at is None else text[:cut_at], cuts)


@pytest.mark.parametrize("name", NAMES)
@given(text=_FREE, cuts=st.lists(st.integers(1, 5)))
@settings(max_examples=150)
def test_any_text_reads_the_same_streamed_and_whole(name: str, text: str, cuts: list[int]) -> None:
    """Text no grammar shaped (half triggers, broken JSON) never fails a parser, and streams as it parses."""
    check_agrees(PARSERS[name], text, cuts)


@pytest.mark.parametrize("name", ["hermes", "smollm2", "llama3_json"])
@given(text=st.text(_TEXT, max_size=40).filter(lambda t: not t.isspace()))
def test_text_without_a_trigger_is_all_content(name: str, text: str) -> None:
    if "<tool_call>" in text or "<|python_tag|>" in text or "{" in text:
        return
    assert PARSERS[name].parse(text) == Parsed(text, ())


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [
        ("hermes", 'Let me check.\n<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>',
         "Let me check.", [("w", '{"city": "Paris"}')]),
        ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "w"}</tool_call>', "", [("w", '{"a": 1}')]),
        ("hermes", "<tool_call>not json</tool_call> then", "<tool_call>not json</tool_call> then", []),
        ("smollm2", "<tool_call>[]</tool_call>", "", []),
        ("smollm2", 'Sure <tool_call>[{"name": "w", "arguments": {}}, {"name": "x", "arguments": {"b": [1]}}]'
         "</tool_call>", "Sure", [("w", "{}"), ("x", '{"b": [1]}')]),
        ("llama3_json", '{"name": "w", "parameters": {"a": 1}}; {"name": "x", "arguments": {}}', "",
         [("w", '{"a": 1}'), ("x", "{}")]),
        ("llama3_json", 'A set {"x": 1} and {"name": "w", "parameters": {}}', 'A set {"x": 1} and', [("w", "{}")]),
        ("generic", '{"response": "Hi \\"you\\" \\ud83d\\ude00\\n"}', 'Hi "you" \U0001f600\n', []),
        ("generic", '{"tool_call": {"name": "w", "arguments": {"a": "b"}}}', "", [("w", '{"a": "b"}')]),
        ("generic", "plain words", "plain words", []),
        ("generic", '{"other": 1}', '{"other": 1}', []),
    ],
)  # fmt: skip
def test_examples(name: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    parsed = PARSERS[name].parse(text)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls], parsed.unfinished) == (content, calls, "")


@pytest.mark.parametrize("name", NAMES)
def test_a_call_cut_after_its_name_is_unfinished_and_its_text_kept(name: str) -> None:
    parser = PARSERS[name]
    text = parser.render_calls([ParsedCall("weather", '{"city": "Paris"}')])
    cut = text[: text.index("Par")]
    parsed = parser.parse(cut)
    assert parsed.calls == () and parsed.message_content == cut.strip()
    out, _ = streamed(parser, cut, [])
    assert out.calls == [["weather", '{"city": "']]  # announced, and its arguments so far


@pytest.mark.parametrize("name", NAMES)
def test_a_call_cut_before_its_name_is_content(name: str) -> None:
    parser = PARSERS[name]
    text = parser.render_calls([ParsedCall("weather", "{}")])
    cut = text[: text.index("weath")]
    out, parsed = streamed(parser, cut, [1] * len(cut))
    assert parsed == Parsed(cut.strip(), ()) and out.calls == []


def test_generic_text_answer_streams_as_content_as_it_is_generated() -> None:
    stream = PARSERS["generic"].stream()
    assert stream.feed('{"response": "Hel') == [Content("Hel")]
    assert stream.feed("lo \\u00") == [Content("lo ")]  # the escape waits for its four digits
    assert stream.feed('e9!"}') == [Content("\u00e9!")]
    assert stream.finish() == []


def test_arguments_stream_before_the_call_closes() -> None:
    stream = PARSERS["hermes"].stream()
    assert stream.feed('Ok <tool_call>\n{"name": "w", "arguments": ') == [Content("Ok"), CallStart(0, "w")]
    assert stream.feed('{"city": "Pa') == [CallArguments(0, '{"city": "Pa')]
    assert stream.feed('ris"}}\n</tool_call>') == [CallArguments(0, 'ris"}')]


@pytest.mark.parametrize(
    ("template", "tokens", "expected"),
    [
        ("{% for m in messages %}<tool_call>{% endfor %}", [], "hermes"),
        ("", ["<tool_call>"], "hermes"),
        ("{{ '<|python_tag|>' }}", [], "llama3_json"),
        ("<|im_start|>", [], "generic"),  # SmolLM2's: measured best with the envelope
        (None, [], "generic"),
    ],
)
def test_default_parser_per_model(template, tokens, expected) -> None:
    assert default_parser_name(template, tokens) == expected
