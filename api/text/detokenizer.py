"""Incremental detokenisation for streaming responses.

The engine produces token ids; the API turns them into text deltas per request. Two things make that
harder than ``decode(new_ids)``:

* Byte-level BPE tokenizers split one UTF-8 character across several tokens, so decoding a prefix
  ends in U+FFFD. Such text is held back until the character completes.
* Stop strings may span tokens, so text that could be the start of a stop string is held back until
  it either completes (generation stops) or stops matching (the text is released).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that are safe to send to a client.

    Uses the prefix/read-offset technique of vLLM and TGI: only a small window of recent tokens is
    decoded per token (the tokens emitted last, as context, plus the ones not yet emitted), so each
    push costs O(window) rather than O(sequence length). Concatenated deltas (plus ``flush()``) equal
    ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`` up to the
    stop string.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        # An empty stop string would match immediately; treat it as absent.
        self._stops: tuple[str, ...] = tuple(s for s in stop if s)
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        # Window of ids: ``_ids[:_read]`` was already turned into text (kept as decoding context so
        # that tokenizers which strip a leading space at the start of a sequence stay correct), and
        # ``_ids[_read:]`` has not produced text yet. Older ids are dropped, so memory stays bounded.
        self._ids: list[int] = []
        self._read = 0
        # Decoded text held back because it might be the start of a stop string.
        self._held = ""
        self._parts: list[str] = []
        self._stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended generation, or None."""
        return self._stop_reason

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned)."""
        return "".join(self._parts)

    def push(self, token_ids: Sequence[int], match_stops: bool = True) -> str:
        """Append newly generated tokens; return the text that is safe to emit now.

        `match_stops` False: the text is not checked against the stop strings (vLLM's min_tokens: a stop string
        in the first tokens does not end the answer), and nothing is held back for them."""
        out: list[str] = []
        for token_id in token_ids:
            if self.stopped:
                break  # Tokens after a stop string are never shown.
            self._ids.append(token_id)
            # Token by token, so a complete character is not held back by a later, incomplete one.
            delta = self._detokenize(final=False)
            if delta:
                out.append(self._emit(delta, final=False, match_stops=match_stops))
        return "".join(out)

    def flush(self) -> str:
        """End of generation: release held-back text, including an incomplete trailing character."""
        if self.stopped:
            return ""
        return self._emit(self._detokenize(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        # No clean-up: it rewrites spaces depending on neighbouring tokens, which a window can't see.
        text = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)
        return text

    def _detokenize(self, final: bool) -> str:
        """Return the new text of the window, or "" while it ends in an incomplete character."""
        prefix = self._decode(self._ids[: self._read])
        full = self._decode(self._ids)
        # Shorter-or-equal means the new tokens decoded to nothing yet (e.g. skipped special tokens).
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        # The emitted tokens become the next window's context; everything older is dropped.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return full[len(prefix) :]

    def _emit(self, new_text: str, final: bool, match_stops: bool = True) -> str:
        """Apply stop strings to newly decoded text; record and return what may be sent."""
        # A stop string can only start inside the held text or the new text: any earlier start
        # would have made its beginning a held-back partial match.
        buf = self._held + new_text
        match = self._find_stop(buf) if match_stops else None
        if match is not None:
            index, stop = match
            self._stop_reason = stop
            out, self._held = buf[: index + len(stop) if self._include_stop else index], ""
        else:
            keep = 0 if final or not match_stops else self._partial_stop_len(buf)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self._parts.append(out)
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest stop string in ``text`` (the longest one on a tie), as (index, stop)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (best is None or (index, -len(stop)) < (best[0], -len(best[1]))):
                best = (index, stop)
        return best

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
