"""A load for serving (`dense_reference=False`, as `serve` loads) keeps no dense copy of what the runner reads
quantised, and answers as the reference load does; a tied Q6_K head is also the embedding tokens are looked up in;
the runner keeps neither the model object nor the loader's weights."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from api.runtime.offline import LLM
from engine.model.linear import Linear, onednn_available
from engine.model.model_runner import TransformersRunner
from engine.model.token_embedding import HeadRows
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import LoadedModel, load_model
from engine.weights.quantization import Int6Weight, Int8Weight
from tests.reference_models import dequantized_model, generate_exactly
from tests.tiny_gguf import write_tiny_tied_q6_k_gguf

PROMPTS = [[5, 9, 12, 40, 7], [100, 3, 3, 8], [17, 250, 61, 2, 90, 11, 4]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tied_q6_k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tied_q6_k_gguf(tmp_path_factory.mktemp("tied-q6-k") / "tiny.Q4_0.gguf")


def _greedy(loaded: LoadedModel, cpu_kernels: bool = True) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(mode="continuous", loaded=loaded, max_num_seqs=4, cpu_kernels=cpu_kernels) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, params)]


def test_a_tied_q6_k_file_loads_one_q6_k_tensor_as_head_and_embedding(tied_q6_k: Path) -> None:
    loaded = load_model(tied_q6_k, dtype="float32", quantization="int4")
    assert loaded.model.config.tie_word_embeddings
    assert loaded.model.lm_head.weight is loaded.model.get_input_embeddings().weight
    head = loaded.quantized["lm_head"]
    assert isinstance(head, Int6Weight) and torch.equal(head.dequantize(), loaded.model.lm_head.weight.data)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_are_looked_up_in_the_heads_q6_k_values_bit_for_bit(tied_q6_k: Path, dtype: str, kernels: bool) -> None:
    """The dense table is the Q6_K values in the activations' dtype: the head's rows, read back from int6_dot's
    layout (or from its dense values without the kernels), are the table's, every token."""
    loaded = load_model(tied_q6_k, dtype=dtype, quantization="int4")
    runner = TransformersRunner(loaded.model, quantized=loaded.quantized, native_attention=kernels)
    assert isinstance(runner.embed, HeadRows)
    ids = torch.arange(loaded.model.config.vocab_size)
    table = loaded.model.get_input_embeddings()(ids)
    assert table.dtype == getattr(torch, dtype) and torch.equal(runner.embed(ids), table)
    untied = load_model(tied_q6_k, dtype=dtype, quantization="none")  # nothing quantised: the model's own table
    assert isinstance(TransformersRunner(untied.model).embed, torch.nn.Embedding)


def test_a_serving_load_keeps_only_shapes_of_what_is_quantised(tied_q6_k: Path, tiny_gguf: Path) -> None:
    tied = load_model(tied_q6_k, dtype="bfloat16", quantization="int4", dense_reference=False)
    modules = dict(tied.model.named_modules())
    for name in tied.quantized:
        assert modules[name].weight.is_meta and modules[name].weight.dtype == torch.bfloat16, name
    assert tied.model.get_input_embeddings().weight.is_meta  # looked up in the Q6_K head
    assert tied.model.get_input_embeddings().weight.shape == (tied.model.config.vocab_size, 256)
    assert not tied.model.model.norm.weight.is_meta and (tied.device, tied.dtype) == (
        torch.device("cpu"),
        torch.bfloat16,
    )
    # SmolLM2's layout: a Q8_0 head apart from a float embedding, which tokens are looked up in
    untied = load_model(tiny_gguf, dtype="float32", quantization="int4", dense_reference=False)
    assert isinstance(untied.quantized["lm_head"], Int8Weight) and untied.model.lm_head.weight.is_meta
    assert not untied.model.get_input_embeddings().weight.is_meta


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_serving_load_answers_as_the_reference_load(tied_q6_k: Path, tiny_gguf: Path, dtype: str) -> None:
    for path in (tied_q6_k, tiny_gguf):
        reference = load_model(path, dtype=dtype, quantization="int4")
        serving = load_model(path, dtype=dtype, quantization="int4", dense_reference=False)
        assert _greedy(serving) == _greedy(reference), path.name


def test_a_serving_load_of_a_tied_q6_k_file_answers_as_generate_on_the_file_dequantised(tied_q6_k: Path) -> None:
    """float32 through torch's ops (no compiled kernels): the int4 weights and the Q6_K head and embedding are the
    file's own float32 values, so greedy tokens are transformers' generate() on the dequantised file, token for
    token."""
    reference = dequantized_model(load_model(tied_q6_k, dtype="float32", quantization="int4"))
    serving = load_model(tied_q6_k, dtype="float32", quantization="int4", dense_reference=False)
    assert _greedy(serving, cpu_kernels=False) == [generate_exactly(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_the_runner_keeps_neither_the_model_nor_the_loaders_weights(tied_q6_k: Path) -> None:
    """What the loader held to build the runner (the model object, its quantised weights before packing) is freed
    with the loaded model: a serving process holds the packed weights once."""
    loaded = load_model(tied_q6_k, dtype="bfloat16", quantization="int4", dense_reference=False)
    runner = TransformersRunner(loaded.model, quantized=loaded.quantized)
    model, projection = weakref.ref(loaded.model), weakref.ref(loaded.quantized["model.layers.0.mlp.down_proj"])
    del loaded
    gc.collect()
    assert model() is None and projection() is None
    assert runner.vocab_size > 0 and isinstance(runner.embed, HeadRows)  # still whole


@pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN")
def test_a_runner_on_a_serving_load_takes_the_dense_weights_it_packs(tiny_gguf: Path) -> None:
    """Dense, a served weight lives in oneDNN's packed copy only (two copies of a 1B's float32 made the first start's
    format measurement peak at 12.5 GiB); a head tied to the embedding would stay (SmolLM2's). The same answers; and a
    second runner on that model is refused by name rather than run on shapes."""
    reference = load_model(tiny_gguf, dtype="float32", quantization="none")
    serving = load_model(tiny_gguf, dtype="float32", quantization="none", dense_reference=False)
    expected = _greedy(reference)
    with LLM(mode="continuous", loaded=serving, max_num_seqs=4) as llm:
        runner = llm.runtime.engine.runner
        assert isinstance(runner, TransformersRunner)
        layer = runner.layers[0]
        assert isinstance(layer.qkv_proj, Linear) and layer.qkv_proj.weight.is_meta
        assert layer.qkv_proj.packed is not None and serving.model.model.layers[0].mlp.down_proj.weight.is_meta
        assert not serving.model.get_input_embeddings().weight.is_meta  # looked up, not packed
        assert runner.lm_head.weight.is_meta  # type: ignore[union-attr]  # an untied head, packed like the rest
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        assert [out.token_ids for out in llm.generate(PROMPTS, params)] == expected
    with pytest.raises(ValueError, match="taken by a runner built before"):
        TransformersRunner(serving.model, keep_model_weights=False)


def test_a_dense_head_tied_to_the_embedding_stays_with_it(tied_q6_k: Path) -> None:
    serving = load_model(tied_q6_k, dtype="float32", quantization="none", dense_reference=False)
    runner = TransformersRunner(serving.model, keep_model_weights=False)
    assert isinstance(runner.embed, torch.nn.Embedding) and not runner.embed.weight.is_meta
    assert isinstance(runner.lm_head, Linear) and runner.lm_head.weight.data_ptr() == runner.embed.weight.data_ptr()
    ids = torch.tensor([3, 7])
    assert torch.equal(runner.embed(ids), load_model(tied_q6_k).model.get_input_embeddings()(ids))
