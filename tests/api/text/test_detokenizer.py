"""Tests for api.text.detokenizer.IncrementalDetokenizer, on a byte-level BPE tokenizer trained offline."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from api.text.detokenizer import IncrementalDetokenizer
from tests.conftest import train_byte_level_tokenizer

EOS = "<|endoftext|>"
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, streaming tokens one at a time",
    "a stop string may span several tokens, so STOP and END are held back",
    "numbers 0123456789 and punctuation: ;,.!?()[]{}",
]
TEXTS = [
    "hello world",
    "café au lait, naïve résumé",
    "日本語のテキスト and English",
    "emoji 🙂🙃 at the end 🎉",
    "mixed: é日🙂x 👩‍👩‍👧 done",
    "  leading and trailing spaces  ",
    "line\nbreaks\n\nand\ttabs",
    "",
]


@functools.cache
def _tokenizer() -> PreTrainedTokenizerFast:
    # Trained on ASCII-only text, so non-ASCII characters fall back to single-byte tokens.
    return train_byte_level_tokenizer(CORPUS, 400, EOS)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer()


def _ids(text: str) -> list[int]:
    return list(_tokenizer().encode(text, add_special_tokens=False))


def _decode(ids: list[int]) -> str:
    text = _tokenizer().decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Push one token at a time; return every delta, the flush last."""
    deltas = [detok.push([i]) for i in ids]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("text", ["é", "日本", "🙂"])
def test_multibyte_characters_span_several_tokens(text: str) -> None:
    # Guards the premise of the other tests: a prefix of the ids decodes to a broken character.
    ids = _ids(text)
    assert len(ids) > len(text)
    assert "\ufffd" in _decode(ids[:1])
    assert _decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = _ids(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == _decode(ids) == text
    assert detok.text == text
    assert not any("\ufffd" in d for d in deltas)
    assert not detok.stopped and detok.stop_reason is None


def test_character_is_held_until_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _ids("🙂")
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_push_several_tokens_at_once(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "mixed: é日🙂x done"
    ids = _ids(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    assert isinstance(eos_id, int)
    ids = [*_ids("hello"), eos_id, *_ids(" world")]
    assert "".join(_stream(IncrementalDetokenizer(tokenizer), ids)) == "hello world"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(_stream(kept, ids)) == f"hello{EOS} world"


def test_flush_emits_incomplete_trailing_character(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _ids("ok 日")[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push([i]) for i in ids) == "ok "
    assert detok.flush() == _decode(ids)[len("ok ") :]
    assert detok.flush() == ""


def test_stop_string_in_middle_truncates(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    out = "".join(_stream(detok, _ids("hello world STOP and more text")))
    assert out == detok.text == "hello world "
    assert detok.stopped and detok.stop_reason == "STOP"
    assert detok.push(_ids(" later")) == ""


def test_stop_string_spanning_multiple_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    stop = "日本🙂"
    ids = _ids(f"before {stop} after")
    assert len(_ids(stop)) > 1
    detok = IncrementalDetokenizer(tokenizer, stop=[stop])
    deltas = _stream(detok, ids)
    assert "".join(deltas) == "before "
    assert detok.stop_reason == stop
    assert not any("日" in d or "\ufffd" in d for d in deltas)


def test_partial_stop_prefix_held_then_released(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP!"])
    emitted = ""
    for token_id in _ids("go STOP and go"):
        emitted += detok.push([token_id])
        # The client never sees a partial stop string.
        assert not emitted.endswith(("S", "ST", "STO", "STOP"))
    emitted += detok.flush()
    assert emitted == "go STOP and go"
    assert not detok.stopped


def test_flush_returns_held_partial_stop(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["ENDING"])
    assert "".join(detok.push([i]) for i in _ids("the END")) == "the "
    assert detok.flush() == "END"
    assert detok.text == "the END"
    assert not detok.stopped


def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(_stream(detok, _ids("hello STOP world"))) == "hello STOP"
    assert detok.stop_reason == "STOP"


def test_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    # Both complete with the token " world"; the one starting first wins, whatever the list order.
    assert _ids("hello world") == [*_ids("hello"), *_ids(" world")]
    detok = IncrementalDetokenizer(tokenizer, stop=["world", "END", "o w"])
    assert detok.push(_ids("hello world END")) == "hell"
    assert detok.stop_reason == "o w"
    # Token by token, the stop string completed first ends generation.
    detok = IncrementalDetokenizer(tokenizer, stop=["dog", "fox"])
    assert "".join(_stream(detok, _ids("the quick brown fox jumps over the lazy dog"))) == "the quick brown "
    assert detok.stop_reason == "fox"


def test_empty_stop_string_ignored(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=[""])
    assert "".join(_stream(detok, _ids("hello"))) == "hello"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40))
def test_property_deltas_match_decode(text: str) -> None:
    ids = _ids(text)
    deltas = _stream(IncrementalDetokenizer(_tokenizer()), ids)
    assert "".join(deltas) == _decode(ids)
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(_tokenizer()) - 1), max_size=30))
def test_property_arbitrary_ids_match_decode(ids: list[int]) -> None:
    # Even invalid byte sequences must concatenate to exactly what a full decode gives.
    assert "".join(_stream(IncrementalDetokenizer(_tokenizer()), ids)) == _decode(ids)


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="ab日🙂 ", max_size=30),
    st.text(alphabet="ab日🙂 ", min_size=1, max_size=4),
    st.booleans(),
)
def test_property_single_stop_string(text: str, stop: str, include: bool) -> None:
    ids = _ids(text)
    detok = IncrementalDetokenizer(_tokenizer(), stop=[stop], include_stop_str_in_output=include)
    out = "".join(_stream(detok, ids))
    full = _decode(ids)
    index = full.find(stop)
    if index < 0:
        assert out == full and not detok.stopped
    else:
        assert out == full[: index + len(stop) if include else index]
        assert detok.stop_reason == stop
