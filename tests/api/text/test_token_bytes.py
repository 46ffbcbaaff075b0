"""api.text.token_bytes: every token's exact bytes, including tokens that hold part of a multi-byte character."""

from __future__ import annotations

import copy

import pytest
from transformers import PreTrainedTokenizerBase

from api.text.token_bytes import TokenBytes, byte_level_alphabet
from tests.server_harness import tiny_tokenizer

TEXTS = ["plain ascii words", "héllo wörld → 世界 🙂", "tab\there\nnewline  two spaces", "€€€ ½"]


def test_byte_level_alphabet_is_a_bijection_onto_all_bytes() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == ord("A") and alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n")


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(text: str) -> None:
    tokenizer = tiny_tokenizer()
    ids = tokenizer(text)["input_ids"]
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(i) for i in ids) == text.encode("utf-8")


def test_a_partial_character_token_keeps_its_own_bytes_not_the_replacement_character() -> None:
    tokenizer = tiny_tokenizer()
    ids = tokenizer("🙂")["input_ids"]  # outside the training corpus: one token per byte
    assert len(ids) > 1
    token_bytes = TokenBytes(tokenizer)
    assert all(len(token_bytes(i)) == 1 for i in ids)
    assert "\ufffd".encode() not in b"".join(token_bytes(i) for i in ids)


class _PieceTokenizer:
    """A SentencePiece-like vocabulary: byte-fallback pieces and word pieces, no byte-level decoder."""

    def __init__(self) -> None:
        self.pieces = {0: "<0xE2>", 1: "▁hello", 2: "<0x82>"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, ids: list[int]) -> str:
        return self.pieces[ids[0]].replace("▁", " ")


def test_sentencepiece_byte_fallback_pieces_and_word_pieces() -> None:
    token_bytes = TokenBytes(_PieceTokenizer())  # type: ignore[arg-type]
    assert token_bytes(0) == b"\xe2" and token_bytes(2) == b"\x82"
    assert token_bytes(1) == b" hello"


def test_a_byte_level_tokenizer_gives_every_single_byte_token_its_byte() -> None:
    tokenizer: PreTrainedTokenizerBase = tiny_tokenizer()
    token_bytes, vocab = TokenBytes(tokenizer), tokenizer.get_vocab()
    for char, byte in byte_level_alphabet().items():
        # Bytes 0x80-0xFF alone are not UTF-8: decoding them gives U+FFFD, so only the byte-level path passes.
        assert token_bytes(vocab[char]) == bytes([byte]), char


def test_added_tokens_are_their_text_in_utf8_not_byte_level_characters() -> None:
    tokenizer = copy.deepcopy(tiny_tokenizer())  # the shared, cached tokenizer must not grow a token
    tokenizer.add_tokens(["é-token"])
    token_id = tokenizer.get_vocab()["é-token"]
    assert TokenBytes(tokenizer)(token_id) == "é-token".encode()
