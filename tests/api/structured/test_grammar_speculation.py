"""xgrammar grammars with n-gram drafts on the real default model (SmolLM2-135M-Instruct, float32): greedy output is
the same with speculation on and off in every mode, drafts are accepted inside the grammar, and each answer
matches its schema. The verify step feeds a row's matcher only the tokens it emits (engine/spec/verify.py), so a
rejected draft never reaches the grammar's state."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from api.runtime.offline import LLM
from api.structured.spec import GrammarKind, GrammarSpec
from api.structured.xgrammar_backend import XGrammarCompiler
from engine.sample.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.weights.loader import LoadedModel
from tests.server_harness import real_loaded_model

pytestmark = pytest.mark.slow

# Repeated keys give the n-gram drafter something to find; the grammar still decides every token.
PEOPLE = {
    "type": "array",
    "minItems": 3,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "city": {"type": "string", "maxLength": 12}},
        "required": ["name", "city"],
        "additionalProperties": False,
    },
}
ASKS = [
    "List three people and the city each lives in, as JSON.",
    "Give three friends with their home towns as a JSON array.",
    "Name three scientists and the city each was born in, in JSON.",
]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4, draft_length="fixed")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return real_loaded_model()


def _params(loaded: LoadedModel) -> SamplingParams:
    vocab_size = int(loaded.model.config.vocab_size)
    compiler = XGrammarCompiler.for_tokenizer(loaded.tokenizer, vocab_size, loaded.eos_token_ids)
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(PEOPLE), "response_format"))
    return SamplingParams(max_tokens=96, temperature=0.0, grammar=grammar)


def _run(loaded: LoadedModel, mode: str, speculative: SpeculativeConfig | None) -> list[Any]:
    template = loaded.tokenizer.apply_chat_template
    texts = [template([{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False) for ask in ASKS]
    prompts = [list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    with LLM(
        mode=mode, loaded=loaded, max_batch_size=3, max_num_seqs=3, max_num_batched_tokens=64, batch_timeout_ms=0.0,
        batch_window_ms=1.0, speculative=speculative,
    ) as llm:  # fmt: skip
        return llm.generate(prompts, _params(loaded))


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
def test_a_grammar_with_drafts_answers_as_without(loaded: LoadedModel, mode: str) -> None:
    plain = _run(loaded, mode, None)
    drafted = _run(loaded, mode, SPEC)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert sum(o.timings.num_accepted_tokens for o in drafted) > 0
    for output in drafted:
        answer = str(loaded.tokenizer.decode(output.token_ids, skip_special_tokens=True))
        jsonschema.validate(json.loads(answer), PEOPLE)
