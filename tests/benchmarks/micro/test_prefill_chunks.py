"""benchmarks/scripts/prefill_chunk.py's `--chunks`: a lone prompt prefilled in steps of each chunk size, on a real
(tiny) engine: every size is timed, the prompt is computed whole each time and the row is taken out after."""

from __future__ import annotations

from transformers import PreTrainedModel

from benchmarks.scripts.prefill_chunk import chunked_prefill_seconds, compare_chunks
from tests.engine.helpers import make_engine, random_prompt


def test_chunked_prefill_computes_the_whole_prompt_and_frees_its_row(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama, enable_prefix_caching=False)  # as the script: each prompt computed whole
    prompt = random_prompt(37, 3, tiny_llama.config.vocab_size)
    steps: list[list[tuple[int, int]]] = []
    step = engine.step
    engine.step = lambda plan: (steps.append(list(plan)), step(plan))[1]  # type: ignore[method-assign]
    assert chunked_prefill_seconds(engine, prompt, 16) > 0
    assert steps == [[(0, 16)], [(0, 16)], [(0, 5)]]
    result = compare_chunks(engine, prompt, [8, 64], repeats=2)
    assert set(result["median_prefill_ms"]) == {"8", "64"}  # type: ignore[arg-type]
    assert all(len(times) == 2 for times in result["prefill_ms"].values())  # type: ignore[attr-defined]
    assert engine.num_free_rows == 8 and not engine.has_sequence(0)  # the row taken out again
