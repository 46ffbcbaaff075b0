"""The raw bytes of one token, for the chat logprobs `bytes` field.

Decoding a lone token that holds part of a multi-byte character gives U+FFFD, whose bytes are not the
token's. Byte-level BPE vocabularies (GPT-2 style, as SmolLM2's) spell each byte as one printable character,
and SentencePiece vocabularies have `<0xNN>` byte-fallback pieces; both map back to the exact bytes. Other
tokens fall back to the UTF-8 of their decoded text.
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet: printable bytes stand for themselves, the other 68
    are shifted to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in alphabet.values())
    for offset, byte in enumerate(shifted):
        alphabet[chr(256 + offset)] = byte
    return alphabet


class TokenBytes:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._alphabet = byte_level_alphabet() if "ByteLevel" in type(decoder).__name__ else None
        # Added tokens are stored as plain text in either kind of vocabulary; the property rebuilds its dict on
        # every read, so it is read once.
        self._added = {i: str(t) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._alphabet is not None:
                if all(c in self._alphabet for c in piece):
                    return bytes(self._alphabet[c] for c in piece)
            else:
                match = _BYTE_PIECE.fullmatch(piece)
                if match:
                    return bytes([int(match.group(1), 16)])
        text = self._tokenizer.decode([token_id])
        return str(text).encode("utf-8")
