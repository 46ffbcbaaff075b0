"""Load a model and run it: runner, engine, scheduler and loop thread, for the HTTP app and the offline `LLM` alike.

Nothing here knows about HTTP: the app adds its service and metrics on top (see `api.apps.serve.build_runtime`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from api.config import RuntimeOptions
from api.runtime.format_choice import gemm_steps
from api.runtime.format_probe import load_auto
from api.structured.grammars import CompileWorkers, build_grammars
from api.text.token_bytes import TokenBytes
from api.text.tool_template import ChatSetup
from engine.config import DEFAULT_MAX_QUANTIZED_ROWS
from engine.engine import Engine
from engine.model.model_runner import ModelRunner, TransformersRunner
from engine.platform.native import load_kernels
from engine.weights.loader import LoadedModel
from scheduler.core import Scheduler
from scheduler.loop import SchedulerLoop
from scheduler.stats import StepStats

if TYPE_CHECKING:
    from api.structured.grammars import Grammars


def load(options: RuntimeOptions) -> LoadedModel:
    """The model in the options' format; what is `auto` is measured on this machine (api/runtime/format_probe.py). The
    kernels the runner will use are built here, if not yet, so that their build (a first start's phase, with its
    progress lines) is not hidden inside preparing the engine."""
    loaded = load_auto(
        options.model,
        device=options.device,
        dtype=options.dtype,
        quantization=options.quantization,
        one_digit=options.int4_gemm == "auto",  # a named scope or off: the switch is measured against the dense copy
    )
    if options.cpu_kernels and loaded.device.type == "cpu":
        load_kernels()
    return loaded


@dataclass(frozen=True)
class ModelRuntime:
    """A loaded model served by one scheduler on its loop thread (not started yet: call `loop.start()`)."""

    engine: Engine
    scheduler: Scheduler
    loop: SchedulerLoop
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    source: str  # the path it was loaded from: the model card's `root`
    max_model_len: int
    token_bytes: TokenBytes  # the tokenizer's byte lookup, built once (chat logprobs' `bytes`)
    grammars: Grammars | None  # structured outputs' compiler; None without xgrammar
    chat: ChatSetup  # the tool parser and the chat templates (api/text/tool_template.py)


def build_runner(options: RuntimeOptions, loaded: LoadedModel) -> TransformersRunner:
    # The row switch `auto` measured (and the row count from which one digit runs), unless the options name a
    # switch other than the default.
    measured = loaded.measured_max_quantized_rows
    use_measured = measured is not None and options.max_quantized_rows == DEFAULT_MAX_QUANTIZED_ROWS
    max_quantized_rows = measured if use_measured else options.max_quantized_rows
    int4_gemm, min_gemm_rows = gemm_steps(
        options.int4_gemm, loaded.measured_min_gemm_rows if use_measured else None, max_quantized_rows
    )
    return TransformersRunner(
        loaded.model,
        prepack_weights=options.cpu_kernels,
        native_attention=options.cpu_kernels,
        quantized=loaded.quantized,
        max_quantized_rows=max_quantized_rows,
        int8_activations=options.int8_activations,
        min_gemm_rows=min_gemm_rows,
        int4_gemm=int4_gemm,
        keep_model_weights=loaded.dense_reference,
    )


def build_model_runtime(
    options: RuntimeOptions,
    loaded: LoadedModel,
    on_step: Callable[[StepStats], None] | None = None,
    runner: ModelRunner | None = None,
    on_policy_fallback: Callable[[], None] | None = None,
    compile_workers: CompileWorkers | None = None,
) -> ModelRuntime:
    """`on_step`: called on the loop thread after each step (the server's metrics); `on_policy_fallback`, each time
    the mode's built-in policy takes over from one that raised. `runner`: one shared with another engine
    (`batchserve compare`: one copy of the weights, stepped by one thread); default: a new one. `compile_workers`:
    grammar compile workers shared with other runtimes of this process; default: its own."""
    device = str(loaded.device)
    runner = runner if runner is not None else build_runner(options, loaded)
    engine = Engine(
        runner,
        options.engine_config(loaded.max_model_len, device),
        loaded.eos_token_ids,
        loaded.max_model_len,
        dtype=loaded.dtype,  # the KV cache in the activations' dtype (the loader cast the model to it)
    )
    scheduler = Scheduler(engine, options.scheduler, on_step=on_step, on_policy_fallback=on_policy_fallback)
    return ModelRuntime(
        engine,
        scheduler,
        SchedulerLoop(scheduler),
        loaded.tokenizer,
        options.model_name(loaded.source),
        loaded.source,
        engine.max_model_len,
        TokenBytes(loaded.tokenizer),
        build_grammars(
            loaded.tokenizer, runner.vocab_size, loaded.eos_token_ids, options.grammar_limits, compile_workers
        ),
        ChatSetup.for_model(loaded.tokenizer, options.tool_call_parser, options.chat_template),
    )
