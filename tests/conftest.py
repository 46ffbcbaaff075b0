"""Shared test helpers: tiny random-initialised causal LMs built from a config (no downloads, CPU, fast)."""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.platform import native
from tests.toolchain import kernel_build_params, load_build


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile (or load) this CPU's kernel build before any test starts a server. Where the cache lacks it the build
    takes a minute or more, and a test server's health wait must not absorb that: under load it once ran past the
    wait's 120 s."""
    native.load_kernels()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m "not slow"` (the fast subset), a test module whose `pytestmark` names `slow` is not imported: each
    of its tests would be deselected anyway, and importing them (Ray, the agent frameworks, Selenium) costs seconds
    of every fast run's collection. Any other marker expression collects everything, as pytest does."""
    if config.getoption("markexpr", "").strip() != "not slow" or not collection_path.name.startswith("test_"):
        return None
    return True if collection_path.suffix == ".py" and module_marked_slow(collection_path.read_text()) else None


def module_marked_slow(source: str) -> bool:
    """Whether a module assigns `pytestmark` a value that names `pytest.mark.slow` at its top level."""
    if "pytestmark" not in source:
        return False
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node.value))
        for node in ast.parse(source).body
    )


def train_byte_level_tokenizer(corpus: list[str], vocab_size: int, eos: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in memory on `corpus` (no downloads): every string encodes, and
    characters outside the corpus fall back to single-byte tokens, so multi-byte characters span several."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 10, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


TINY_ARCHITECTURES: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
TINY_VOCAB_SIZE = 160
TINY_MAX_POSITIONS = 256


def build_tiny_causal_lm(
    arch: str,
    *,
    seed: int = 0,
    vocab_size: int = TINY_VOCAB_SIZE,
    initializer_range: float = 0.1,
    hidden_size: int = 64,
    intermediate_size: int = 128,
) -> PreTrainedModel:
    """A 2-layer, hidden-64 (by default) GQA decoder of the given family with random weights, in eval mode.

    The weights are larger than the default init (initializer_range 0.1) so next-token distributions are
    peaked and greedy choices are not near-ties. Norm weights and (for Qwen2) the q/k/v biases are
    randomised too, so code that ignores them cannot pass. No special tokens are configured and the
    generation config has no EOS, so `generate()` always produces exactly `max_new_tokens` tokens.
    """
    config_cls, model_cls = TINY_ARCHITECTURES[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=intermediate_size,
        max_position_embeddings=TINY_MAX_POSITIONS,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    # Distinct weights per family even where the architectures coincide (Mistral is Llama-shaped).
    torch.manual_seed(1000 * seed + list(TINY_ARCHITECTURES).index(arch))
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    return model


@pytest.fixture(scope="session")
def tiny_model_builder() -> Callable[..., PreTrainedModel]:
    """`build(arch, seed=0, vocab_size=160)` -> a cached tiny model; arch is 'llama', 'qwen2' or 'mistral'.

    Models are shared within the session: treat them as read-only.
    """
    cache: dict[tuple, PreTrainedModel] = {}

    def build(arch: str, *, seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedModel:
        key = (arch, seed, vocab_size)
        if key not in cache:
            cache[key] = build_tiny_causal_lm(arch, seed=seed, vocab_size=vocab_size)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_builder: Callable[..., PreTrainedModel]) -> PreTrainedModel:
    return tiny_model_builder("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_builder: Callable[..., PreTrainedModel]) -> PreTrainedModel:
    return tiny_model_builder("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_builder: Callable[..., PreTrainedModel]) -> PreTrainedModel:
    return tiny_model_builder("mistral")


# ----- a pair of tiny-model servers, one per mode, shared by the API test modules -----
@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    from tests.server_harness import mode_config, running_server  # lazy: server_harness imports this module

    with running_server(mode_config("dynamic")) as dynamic, running_server(mode_config("continuous")) as continuous:
        yield {"dynamic": dynamic, "continuous": continuous}


@pytest.fixture(params=["dynamic", "continuous"])
def server(request: pytest.FixtureRequest, servers: dict[str, Any]) -> Any:
    return servers[request.param]


@pytest.fixture
def client(server: Any) -> Any:
    from tests.server_harness import openai_client

    return openai_client(server)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture every log record, uvicorn's too (its loggers do not propagate to the root)."""
    caplog.set_level(logging.DEBUG)
    names = ["uvicorn", "uvicorn.error", "uvicorn.access"]
    for name in names:
        logging.getLogger(name).addHandler(caplog.handler)
    yield caplog
    for name in names:
        logging.getLogger(name).removeHandler(caplog.handler)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Servers of a module compute with one thread (a request's speed is not what the module tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and tokenizer saved as a Hugging Face checkpoint directory, loadable with --model."""
    from tests.server_harness import tiny_loaded_model, tiny_tokenizer  # the harness imports this module

    directory = tmp_path_factory.mktemp("tiny-checkpoint")
    tiny_loaded_model().model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a GGUF file with Q4_1 projections (tests/tiny_gguf.py)."""
    from tests.tiny_gguf import write_tiny_gguf  # imports the harness, which imports this module

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.Q4_1.gguf")


@pytest.fixture(scope="module", params=kernel_build_params())
def kernels(request: pytest.FixtureRequest) -> native.Kernels:
    """Each build of the compiled kernels this CPU can execute, in turn (engine/platform/native.py); the others skip."""
    return load_build(request.param)
