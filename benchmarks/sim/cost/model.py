"""How long one engine step takes, as a function of what the step computes: the simulator's only notion of time.

Two models share one interface (`CostModel.step_time(StepShape, idle_s)`):

- `FittedCostModel`, measured on this machine by `benchmarks.sim.profiling.steps` and fitted by least squares:

      t = a + b*T + c*max(0, T - k) + d*S + e*A

  T: tokens computed in the step (prompt chunks plus decode tokens), S: sequences in the step, A: attention
  work in millions of (query token, key position) pairs. `a` is the fixed cost of a step, `b` the cost of a
  token while the weight reads dominate, `c` the extra cost per token once the matmuls turn compute-bound past
  a knee of k tokens (on a CPU, a batch-8 step costs little more than batch 1, a batch-32 step about 3x),
  `d` the per-row cost (sampling, bookkeeping), `e` attention over the context. All coefficients are kept
  non-negative; k is the best of a grid of candidate knees.

  Where the engine switches weights by step size (quantised up to `max_quantized_rows` tokens a step, a dense
  copy past it: engine.linear.RowSwitchedLinear), cost is not one smooth function of T: past the switch the
  fixed cost jumps and the per-token cost drops. `SwitchedCostModel` then holds one fitted model per regime.

  A step that starts after the engine sat idle for `COLD_AFTER_S` or more costs `cold_step_s` more: the
  compute threads have gone to sleep and the weights have left the nearest caches (measured on the 2-core Xeon:
  a batch-1 decode step 6.3 ms warm, 10.6 ms after 1 s idle). `benchmarks.sim.profiling.steps` measures it per
  regime; it is what a lone request at light load pays on its first step, and at most once per burst.

  A request also pays for what is not a step: HTTP, tokenising, the loop's wake-up, SSE framing. cost.json's
  `served` section (`benchmarks.sim.profiling.served_probe`, lone requests through a real server) holds that time,
  `outside_step_s`, which the simulator adds to each request's latency (`load_request_overhead`), and the served
  lone prefill, from which the profile sets the prefill regime's cold cost.

- `RooflineCostModel`, a projection for a GPU from public specs: the larger of the FLOPs over achievable peak
  compute and the bytes moved (weights once per step, plus each sequence's KV cache) over achievable memory
  bandwidth, plus a fixed per-step overhead. Its output is a projection, never a measurement.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from benchmarks.results_io.report import write_json

COLD_AFTER_S = 0.2  # idle this long and the next step is cold (measured: +0 ms after 50 ms idle, +2.4 ms after 0.2 s)


@dataclass(frozen=True)
class StepShape:
    """What one step computes, in the terms the cost models use."""

    num_seqs: int  # S: sequences computed
    num_tokens: int  # T: tokens computed (prompt chunks plus decode tokens)
    num_sampled: int  # sequences whose pending tokens ran out, so a token is sampled (the LM head runs for them)
    attention_pairs: int  # A: sum over computed tokens of the positions each attends to (its own included)
    kv_tokens: int  # sum over sequences of the context held in cache after the step (KV bytes read)


def chunk_attention_pairs(computed: int, count: int) -> int:
    """Attention pairs of `count` new tokens after `computed` cached ones: token i attends to computed + i + 1."""
    return count * computed + count * (count + 1) // 2


class CostModel(Protocol):
    @property
    def label(self) -> str:
        """One line naming the model, for reports ("fitted on ...", "projection: ...")."""

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:
        """Seconds for one engine step of this shape, started `idle_s` after the engine's previous step ended."""


# ----- the fitted (measured) model -----
FEATURES = ("const", "tokens", "tokens_over_knee", "seqs", "attention_mpairs")


@dataclass(frozen=True)
class FittedCostModel:
    const_s: float
    per_token_s: float
    per_token_over_knee_s: float
    knee_tokens: int
    per_seq_s: float
    per_attention_mpair_s: float
    source: str = "synthetic"  # what was measured: machine, model, threads
    cold_step_s: float = 0.0  # extra for a step after at least COLD_AFTER_S of idle

    def __post_init__(self) -> None:
        values = (self.const_s, self.per_token_s, self.per_token_over_knee_s, self.per_seq_s, self.cold_step_s)
        if any(not (v >= 0 and math.isfinite(v)) for v in (*values, self.per_attention_mpair_s)):
            raise ValueError(f"cost coefficients must be finite and >= 0: {self}")
        if self.knee_tokens < 0:
            raise ValueError(f"knee_tokens must be >= 0, got {self.knee_tokens}")

    @property
    def label(self) -> str:
        return f"fitted step-cost model ({self.source})"

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:
        return (
            (self.cold_step_s if idle_s >= COLD_AFTER_S else 0.0)
            + self.const_s
            + self.per_token_s * shape.num_tokens
            + self.per_token_over_knee_s * max(0, shape.num_tokens - self.knee_tokens)
            + self.per_seq_s * shape.num_seqs
            + self.per_attention_mpair_s * shape.attention_pairs * 1e-6
        )


@dataclass(frozen=True)
class SwitchedCostModel:
    """Two fitted regimes, split by the step's token count as the engine splits its weights."""

    small: FittedCostModel  # steps of at most `max_small_tokens` tokens (quantised weights)
    large: FittedCostModel  # longer steps (the dense copy)
    max_small_tokens: int

    @property
    def label(self) -> str:
        return f"fitted step-cost model, two regimes split at {self.max_small_tokens} tokens ({self.small.source})"

    def regime(self, shape: StepShape) -> FittedCostModel:
        return self.small if shape.num_tokens <= self.max_small_tokens else self.large

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:
        return self.regime(shape).step_time(shape, idle_s)


@dataclass(frozen=True)
class FitReport:
    model: FittedCostModel | SwitchedCostModel
    mean_abs_pct_error: float  # over the measured points
    max_abs_pct_error: float
    r_squared: float


def _design(shapes: Sequence[StepShape], knee: int) -> np.ndarray:
    rows = [(1.0, s.num_tokens, max(0, s.num_tokens - knee), s.num_seqs, s.attention_pairs * 1e-6) for s in shapes]
    return np.asarray(rows, dtype=np.float64)  # [points, features]


def fit_cost_model(
    shapes: Sequence[StepShape],
    seconds: Sequence[float],
    source: str,
    knees: Sequence[int] | None = None,
    switch_tokens: int | None = None,
) -> FitReport:
    """Non-negative least squares on relative error (each point weighted by 1/t, so a 5 ms step counts as much
    as a 500 ms one), for each candidate knee; the knee with the smallest error wins. `switch_tokens`: fit steps
    of at most that many tokens and longer ones separately (a SwitchedCostModel)."""
    if switch_tokens is not None:
        return _fit_switched(shapes, seconds, source, switch_tokens)
    if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps, one time per shape")
    times = np.asarray(seconds, dtype=np.float64)
    if not bool(np.all(times > 0)):
        raise ValueError("step times must be positive")
    if knees is None:
        top = max(s.num_tokens for s in shapes)
        knees = sorted({0, *(int(k) for k in np.unique([s.num_tokens for s in shapes]) if k < top)})
    best: tuple[float, int, np.ndarray] | None = None
    for knee in knees:
        design = _design(shapes, knee) / times[:, None]
        coef, residual = _nonnegative_lstsq(design, np.ones_like(times))
        if best is None or residual < best[0] - 1e-15:
            best = (residual, knee, coef)
    assert best is not None
    _, knee, coef = best
    model = FittedCostModel(
        const_s=float(coef[0]),
        per_token_s=float(coef[1]),
        per_token_over_knee_s=float(coef[2]),
        knee_tokens=int(knee),
        per_seq_s=float(coef[3]),
        per_attention_mpair_s=float(coef[4]),
        source=source,
    )
    return _report(model, shapes, times)


def _fit_switched(shapes: Sequence[StepShape], seconds: Sequence[float], source: str, switch_tokens: int) -> FitReport:
    small = [i for i, s in enumerate(shapes) if s.num_tokens <= switch_tokens]
    large = [i for i, s in enumerate(shapes) if s.num_tokens > switch_tokens]
    fits = []
    for side in (small, large):
        if len(side) < len(FEATURES):
            raise ValueError(
                f"need at least {len(FEATURES)} measured steps on each side of the {switch_tokens}-token switch"
            )
        fits.append(fit_cost_model([shapes[i] for i in side], [seconds[i] for i in side], source).model)
    small_model, large_model = fits
    assert isinstance(small_model, FittedCostModel) and isinstance(large_model, FittedCostModel)
    model = SwitchedCostModel(small_model, large_model, switch_tokens)
    return _report(model, shapes, np.asarray(seconds, dtype=np.float64))


def _report(model: FittedCostModel | SwitchedCostModel, shapes: Sequence[StepShape], times: np.ndarray) -> FitReport:
    predicted = np.asarray([model.step_time(s) for s in shapes])
    errors = np.abs(predicted - times) / times
    total = float(np.sum((times - times.mean()) ** 2))
    r_squared = 1.0 - float(np.sum((predicted - times) ** 2)) / total if total > 0 else 1.0
    return FitReport(model, float(errors.mean()), float(errors.max()), r_squared)


def _nonnegative_lstsq(design: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with every coefficient >= 0, exactly: the optimum is the unconstrained fit on its own support,
    so try the fit on every subset of the (five) features and keep the best one that is non-negative."""
    features = design.shape[1]
    best_coef, best_residual = np.zeros(features), float(np.sum(target**2))
    for size in range(1, features + 1):
        for support in itertools.combinations(range(features), size):
            columns = list(support)
            solution, *_ = np.linalg.lstsq(design[:, columns], target, rcond=None)
            if bool(np.any(solution < 0)):
                continue
            coef = np.zeros(features)
            coef[columns] = solution
            residual = float(np.sum((design @ coef - target) ** 2))
            if residual < best_residual:
                best_coef, best_residual = coef, residual
    return best_coef, best_residual


# ----- the roofline (projected) model -----
@dataclass(frozen=True)
class GpuSpec:
    """Public datasheet peaks (dense, no sparsity) and the fraction of each a serving engine achieves."""

    name: str
    peak_flops: float  # FLOP/s at 16-bit precision
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    flops_efficiency: float = 0.6  # large GEMMs reach about 60-75 % of peak
    bandwidth_efficiency: float = 0.8  # streaming weight reads reach about 80 % of peak bandwidth


GPUS: Mapping[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 SXM5 80GB", 989e12, 3.35e12, 80e9),
    "a100": GpuSpec("NVIDIA A100 SXM4 80GB", 312e12, 2.039e12, 80e9),
    "l4": GpuSpec("NVIDIA L4 24GB", 121e12, 300e9, 24e9),
    "h200": GpuSpec("NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 141e9),
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that set its step cost."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    param_bytes: int = 2  # bytes per weight (bf16/fp16: 2)
    kv_bytes: int = 2  # bytes per cached key or value element
    max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, config: Any, name: str, param_bytes: int = 2, kv_bytes: int = 2) -> ModelShape:
        """From a transformers `PretrainedConfig` (Llama, Mistral, Qwen2 and alike)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            name=name,
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            param_bytes=param_bytes,
            kv_bytes=kv_bytes,
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 8192)),
        )

    @property
    def layer_matmul_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embeddings = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.num_layers * self.layer_matmul_params + self.lm_head_params + embeddings + norms

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.param_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_bytes


@dataclass(frozen=True)
class RooflineCostModel:
    gpu: GpuSpec
    model: ModelShape
    step_overhead_s: float = 1e-3  # launch and scheduling cost of a step that the roofline does not see

    @property
    def label(self) -> str:
        return f"PROJECTION: roofline of {self.model.name} on {self.gpu.name} (not a measurement)"

    def flops(self, shape: StepShape) -> float:
        m = self.model
        matmuls = 2.0 * m.num_layers * m.layer_matmul_params * shape.num_tokens
        lm_head = 2.0 * m.lm_head_params * shape.num_sampled
        attention = 4.0 * m.num_layers * m.num_heads * m.head_dim * shape.attention_pairs  # QK^T and PV
        return matmuls + lm_head + attention

    def bytes_moved(self, shape: StepShape) -> float:
        m = self.model
        weights = (m.num_layers * m.layer_matmul_params + m.lm_head_params) * m.param_bytes
        # Each sequence's cache is read once per step (flash-style attention); new keys and values are written.
        return float(weights + m.kv_bytes_per_token * (shape.kv_tokens + shape.num_tokens))

    def compute_time(self, shape: StepShape) -> float:
        return self.flops(shape) / (self.gpu.peak_flops * self.gpu.flops_efficiency)

    def memory_time(self, shape: StepShape) -> float:
        return self.bytes_moved(shape) / (self.gpu.memory_bandwidth * self.gpu.bandwidth_efficiency)

    def bound(self, shape: StepShape) -> str:
        return "memory" if self.memory_time(shape) >= self.compute_time(shape) else "compute"

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:  # a GPU keeps no such state: idle_s unused
        return self.step_overhead_s + max(self.compute_time(shape), self.memory_time(shape))

    def kv_cache_tokens(self, memory_fraction: float = 0.9) -> int:
        """Tokens of KV cache that fit beside the weights in `memory_fraction` of the GPU's memory."""
        free = self.gpu.memory_bytes * memory_fraction - self.model.weight_bytes
        if free <= 0:
            size = f"{self.model.weight_bytes / 1e9:.1f} GB"
            raise ValueError(f"{self.model.name} ({size}) does not fit on {self.gpu.name}")
        return int(free // self.model.kv_bytes_per_token)


# ----- built-in model configs and files -----
BUILTIN_CONFIGS: Mapping[str, dict[str, Any]] = {
    "smollm2-135m": {  # the default model's shape
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
}


def load_model_shape(name_or_dir: str, param_bytes: int = 2, kv_bytes: int = 2) -> ModelShape:
    """A built-in name (`BUILTIN_CONFIGS`: llama-3-8b, ...) or a directory holding a transformers `config.json`."""
    from transformers import AutoConfig, LlamaConfig  # heavy import, only for GPU projections

    if name_or_dir in BUILTIN_CONFIGS:
        config: Any = LlamaConfig(**BUILTIN_CONFIGS[name_or_dir])
        name = name_or_dir
    else:
        path = Path(name_or_dir)
        if not (path / "config.json").is_file():
            known = ", ".join(BUILTIN_CONFIGS)
            raise ValueError(f"--model-config: {name_or_dir!r} is neither a built-in ({known}) nor a config dir")
        config = AutoConfig.from_pretrained(path)
        name = path.name
    return ModelShape.from_config(config, name, param_bytes, kv_bytes)


_FORM = "t = const + tokens*T + tokens_over_knee*max(0, T - knee) + seqs*S + attention_mpairs*A/1e6"


def save_fitted(report: FitReport, path: Path, extra: Mapping[str, Any]) -> None:
    switched = isinstance(report.model, SwitchedCostModel)
    document = {
        "form": f"{_FORM}, one per regime: 'small' for T <= max_small_tokens, else 'large'" if switched else _FORM,
        "model": asdict(report.model),
        "fit": {
            "mean_abs_pct_error": 100 * report.mean_abs_pct_error,
            "max_abs_pct_error": 100 * report.max_abs_pct_error,
            "r_squared": report.r_squared,
        },
        **extra,
    }
    write_json(path, document)


def load_fitted(path: Path) -> FittedCostModel | SwitchedCostModel:
    document = json.loads(Path(path).read_text())
    try:
        model = document["model"]
        if "small" in model:
            return SwitchedCostModel(
                FittedCostModel(**model["small"]), FittedCostModel(**model["large"]), int(model["max_small_tokens"])
            )
        return FittedCostModel(**model)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a cost model written by benchmarks.sim.profiling.steps: {exc}") from exc


def served_section(path: Path) -> dict[str, Any]:
    """cost.json's `served` section: what the profile measured through a real server (empty when it did not)."""
    served: dict[str, Any] = json.loads(Path(path).read_text()).get("served") or {}
    return served


@dataclass(frozen=True)
class BusyArrival:
    """What a request that arrives while the engine steps costs beyond one that finds it idle (the served probe's
    busy phase): the next step starts `stall_s` later, and the request's own path outside the steps is
    `outside_s` longer. Its intake (reading, parsing, tokenising) runs on the cores the compute threads use."""

    stall_s: float = 0.0
    outside_s: float = 0.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (self.stall_s, self.outside_s)):
            raise ValueError(f"busy-arrival costs must be finite and >= 0: {self}")


def load_busy_arrival(path: Path) -> BusyArrival:
    """The served probe's busy-arrival costs from cost.json (none when the profile predates them)."""
    served = served_section(path)
    try:
        return BusyArrival(float(served.get("busy_stall_s", 0.0)), float(served.get("busy_outside_s", 0.0)))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: served.busy_stall_s / busy_outside_s: {exc}") from exc


def load_request_overhead(path: Path) -> float:
    """Seconds a request pays outside the engine's steps, from cost.json's served probe (0 when it has none)."""
    served = served_section(path)
    value = float(served.get("outside_step_s", 0.0))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{path}: served.outside_step_s must be a finite number >= 0, got {value}")
    return value
