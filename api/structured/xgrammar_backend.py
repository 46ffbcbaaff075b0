"""Grammar specs compiled with xgrammar: the only module that imports it.

The server compiles in worker processes (api/structured/compile_worker.py, driven by api/structured/grammars.py):
`setup()` is what a worker needs (the tokenizer's table of every token's bytes, serialized), `compile_bytes` runs
there and answers a compiled grammar serialized, and `load` turns that back into a `Grammar` here. `compile` does
all of it in one process (benchmarks, tests).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from api.structured.spec import GrammarCompileError, GrammarKind, GrammarSpec

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from engine.sample.grammar import GrammarMatcher

# JSON grammars allow at most this many whitespace characters in a row: enough for a newline and an indent, too few
# for a small model to spend its max_tokens on spaces (the failure users report of unbounded JSON whitespace).
MAX_JSON_WHITESPACE = 4
_CACHE_BYTES = 64 * 2**20  # the worker's own cache: a spec whose grammar the server evicted recompiles fast
_ANY_OBJECT = json.dumps({"type": "object"})
# Where a structural tag's formats hold other formats.
_FORMAT_KEYS = frozenset({"format", "tags", "content", "elements"})
# xgrammar's messages start with "[time] /path/file.cc:line: "; the rest is the reason.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class _Matcher:
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class _Grammar:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._compiled = compiled

    def matcher(self) -> GrammarMatcher:
        return _Matcher(xgr.GrammarMatcher(self._compiled))

    @property
    def size_bytes(self) -> int:
        return int(self._compiled.memory_size_bytes)


class XGrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer; thread-safe."""

    def __init__(self, info: xgr.TokenizerInfo, max_whitespace: int = MAX_JSON_WHITESPACE) -> None:
        self._info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=_CACHE_BYTES)
        self.max_whitespace = max_whitespace

    @classmethod
    def for_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> XGrammarCompiler:
        """About 0.1 s: a table of every token's bytes."""
        return cls(
            xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[*stop_token_ids])
        )

    def setup(self) -> bytes:
        """What a worker process needs to compile as this compiler does (`from_setup`)."""
        return json.dumps({"tokenizer": self._info.serialize_json(), "max_whitespace": self.max_whitespace}).encode()

    @classmethod
    def from_setup(cls, setup: bytes) -> XGrammarCompiler:
        fields = json.loads(setup)
        return cls(xgr.TokenizerInfo.deserialize_json(fields["tokenizer"]), int(fields["max_whitespace"]))

    def compile(self, spec: GrammarSpec) -> _Grammar:
        """Raises GrammarCompileError for a spec that does not compile or admits no answer at all."""
        return _Grammar(self._checked(spec))

    def compile_bytes(self, spec: GrammarSpec) -> bytes:
        """`compile`, serialized for `load` (in a worker process)."""
        return self._checked(spec).serialize_json().encode()

    def load(self, data: bytes) -> _Grammar:
        """A grammar `compile_bytes` made, for this compiler's tokenizer (a few ms for a large one)."""
        return _Grammar(xgr.CompiledGrammar.deserialize_json(data.decode(), self._info))

    def _checked(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError) as exc:
            raise GrammarCompileError(_SOURCE_PREFIX.sub("", str(exc)).strip() or type(exc).__name__) from None
        if not _admits_a_first_token(compiled, self._info.vocab_size):
            # `root ::= root "a"`, the regex `[^\s\S]`, `allOf: [{"$ref": "#"}]`: no answer, not even an empty one.
            raise GrammarCompileError("it admits no answer: no token, not even the end, can come first")
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self._compiler
        if spec.kind is GrammarKind.JSON_SCHEMA:
            return compiler.compile_json_schema(spec.text, max_whitespace_cnt=self.max_whitespace)
        if spec.kind is GrammarKind.JSON_OBJECT:
            return compiler.compile_json_schema(_ANY_OBJECT, strict_mode=False, max_whitespace_cnt=self.max_whitespace)
        if spec.kind is GrammarKind.REGEX:
            return compiler.compile_regex(spec.text)
        if spec.kind is GrammarKind.STRUCTURAL_TAG:
            return compiler.compile_structural_tag(_bounded_whitespace(json.loads(spec.text), self.max_whitespace))
        if spec.kind is GrammarKind.CHOICE:
            # JSON string literals are EBNF string literals (the same escapes).
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choices))
        return compiler.compile_grammar(spec.text)


def _bounded_whitespace(structural_tag: Any, limit: int) -> str:
    """The structural tag's JSON with every JSON-schema part bounded in whitespace as compiled schemas are."""
    stack = [structural_tag]
    while stack:  # not recursive: tags nest formats, and the schemas inside them are not walked (only formats)
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if item.get("type") == "json_schema" and "json_schema" in item:
                item.setdefault("max_whitespace_cnt", limit)
                continue
            stack.extend(value for key, value in item.items() if key in _FORMAT_KEYS)
    return json.dumps(structural_tag)


def _admits_a_first_token(compiled: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """Some token may start the answer (the stop token counts where the empty answer is allowed)."""
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())
