"""Grammar specs compiled with xgrammar: the only module that imports it.

The compiler is built once per server from the tokenizer (a table of every token's bytes, about 0.1 s) and keeps
its compiled grammars in a cache keyed by their text, bounded in bytes, so a schema a client sends again compiles in
microseconds. `compile` runs on a worker thread (api/endpoints/routes.py), never on the scheduler's step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from api.structured.spec import GrammarCompileError, GrammarKind, GrammarSpec
from engine.grammar import Grammar, GrammarMatcher

# JSON grammars allow at most this many whitespace characters in a row: enough for a newline and an indent, too few
# for a small model to spend its max_tokens on spaces (the failure users report of unbounded JSON whitespace).
MAX_JSON_WHITESPACE = 4
_CACHE_BYTES = 256 * 2**20
_ANY_OBJECT = json.dumps({"type": "object"})
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


class XGrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_whitespace: int = MAX_JSON_WHITESPACE,
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=_CACHE_BYTES)
        self.max_whitespace = max_whitespace

    def compile(self, spec: GrammarSpec) -> Grammar:
        try:
            return _Grammar(self._compile(spec))
        except (RuntimeError, ValueError) as exc:
            raise GrammarCompileError(_SOURCE_PREFIX.sub("", str(exc)).strip() or type(exc).__name__) from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self._compiler
        if spec.kind is GrammarKind.JSON_SCHEMA:
            return compiler.compile_json_schema(spec.text, max_whitespace_cnt=self.max_whitespace)
        if spec.kind is GrammarKind.JSON_OBJECT:
            return compiler.compile_json_schema(_ANY_OBJECT, strict_mode=False, max_whitespace_cnt=self.max_whitespace)
        if spec.kind is GrammarKind.REGEX:
            return compiler.compile_regex(spec.text)
        if spec.kind is GrammarKind.CHOICE:
            # JSON string literals are EBNF string literals (the same escapes).
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choices))
        return compiler.compile_grammar(spec.text)
