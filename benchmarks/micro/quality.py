"""What a faster weight format costs in quality: perplexity and greedy agreement against float32.

For each `dtype/quantization` setting the script loads the served model through the offline API and measures:
- perplexity on the reference texts (`../shared/reference/*.txt` by default), scored through prompt logprobs in
  chunks of `--chunk` tokens, exactly as a client's `prompt_logprobs` would see them;
- the RMS of each scored token's log-probability change from float32's: a rounding's size, token by token, where
  perplexity nets ups against downs (a setting's changes add up in its square, one source at a time);
- greedy agreement with the float32 run over `--max-tokens` tokens for `--prompts` prompts: where the first
  differing token falls, and how close float32's top two candidates were there (a gap near zero means the
  float32 choice was itself a coin toss, so a rounding change flips it).

The baseline is `float32/none` on the same file: for a GGUF that is its weights dequantised to float32, so
"int4 from the Q4_1 file" is compared with the very weights it was packed from.

    python -m benchmarks quality [--model PATH] [--settings float32/none,bfloat16/none,bfloat16/int4]
                                 [--prompts 16] [--max-tokens 64] [--chunk 512] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from api.runtime.offline import LLM
from benchmarks.results_io.machine import dated_result_dir
from benchmarks.results_io.report import write_json
from engine.sample.sampling_params import SamplingParams

DEFAULT_TEXTS = Path(__file__).resolve().parents[3] / "shared" / "reference"
BASELINE = "float32/none"
PPL_TOLERANCE = 0.01  # the issue's bar: within 1% of float32's perplexity


# How quantised weights run, as `DTYPE/QUANTIZATION:STEPS`. The server switches by step size, so a run of many
# rows (prompt scoring, 16 greedy prompts at once) would measure the dense copy; these force one path for all.
STEPS = {
    "switched": {},  # the server's default: quantised up to 10 rows a step, the dense copy past that
    "quantized": {"max_quantized_rows": None},  # every step quantised, int8 activations where the CPU has VNNI
    "quantized-float": {"max_quantized_rows": None, "int8_activations": False},  # ... and float activations
    "gemm": {"int4_gemm": "all"},  # int4: past the row switch int4_gemm (one int8 digit), no dense copy
    "gemm-except-qkv": {"int4_gemm": "except-qkv"},  # ... for every projection but the attention's q/k/v
}


@dataclass(frozen=True)
class Setting:
    dtype: str
    quantization: str
    steps: str = "switched"

    @classmethod
    def parse(cls, text: str) -> Setting:
        formats, _, steps = text.partition(":")
        dtype, _, quantization = formats.partition("/")
        if not dtype or not quantization or (steps and steps not in STEPS):
            raise argparse.ArgumentTypeError(
                f"expected DTYPE/QUANTIZATION[:{'|'.join(STEPS)}] such as bfloat16/int4:quantized, got {text!r}"
            )
        return cls(dtype, quantization, steps or "switched")

    @property
    def name(self) -> str:
        suffix = "" if self.steps == "switched" else f":{self.steps}"
        return f"{self.dtype}/{self.quantization}{suffix}"


@dataclass(frozen=True)
class Divergence:
    prompt: int
    first_difference: int | None  # index of the first token that differs from float32's; None: all equal
    top2_gap: float | None  # float32's logprob margin between its top two candidates at that position


@dataclass(frozen=True)
class SettingResult:
    setting: str
    perplexity: float
    perplexity_ratio: float  # over the baseline's
    logprob_rms: float  # RMS of each scored token's log-probability change from the baseline's
    scored_tokens: int
    identical_prompts: int
    divergences: tuple[Divergence, ...]

    @property
    def median_first_difference(self) -> float | None:
        firsts = [d.first_difference for d in self.divergences if d.first_difference is not None]
        return statistics.median(firsts) if firsts else None


def reference_chunks(llm: LLM, texts_dir: Path, chunk: int) -> list[list[int]]:
    """The reference texts as token chunks of at most `chunk` tokens (each at least 2: one is scored)."""
    chunks: list[list[int]] = []
    for path in sorted(texts_dir.glob("*.txt")):
        ids = list(llm.tokenizer(path.read_text(encoding="utf-8"))["input_ids"])
        chunks.extend(ids[i : i + chunk] for i in range(0, len(ids), chunk) if len(ids[i : i + chunk]) >= 2)
    if not chunks:
        raise SystemExit(f"no reference texts (*.txt) in {texts_dir}")
    return chunks


def greedy_prompts(chunks: Sequence[Sequence[int]], count: int, length: int = 24) -> list[list[int]]:
    """`count` prompts cut from the reference texts at evenly spaced places, so they read as real prose."""
    flat = [t for c in chunks for t in c]
    stride = max(1, (len(flat) - length) // count)
    return [flat[i * stride : i * stride + length] for i in range(count)]


def scored_logprobs(llm: LLM, chunks: Sequence[list[int]]) -> list[float]:
    """Each chunk's tokens after its first, scored: their log-probabilities in order."""
    outputs = llm.generate(list(chunks), SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    return [lp for out in outputs if out.prompt_logprobs is not None for lp in out.prompt_logprobs.logprobs]


def perplexity(logprobs: Sequence[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def rms_change(logprobs: Sequence[float], baseline: Sequence[float]) -> float:
    return math.sqrt(sum((a - b) ** 2 for a, b in zip(logprobs, baseline, strict=True)) / len(baseline))


def greedy(llm: LLM, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(list(prompts), params)]


def top2_gaps(llm: LLM, prompts: Sequence[list[int]], outputs: Sequence[list[int]]) -> list[list[float]]:
    """For each prompt, the margin between the two best logprobs at every generated position, scored by
    re-reading prompt + output (teacher forcing)."""
    sequences = [p + o for p, o in zip(prompts, outputs, strict=True)]
    scored = llm.generate(sequences, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    gaps = []
    for prompt, out in zip(prompts, scored, strict=True):
        assert out.prompt_logprobs is not None
        top = out.prompt_logprobs.top[len(prompt) - 1 :]  # top[i] scores position first_position + i (= 1 + i)
        gaps.append([(t[0][1] - t[1][1]) if len(t) > 1 else math.inf for t in top])
    return gaps


def compare(
    reference: Sequence[list[int]], candidate: Sequence[list[int]], gaps: Sequence[list[float]]
) -> list[Divergence]:
    result = []
    for index, (ref, cand, gap) in enumerate(zip(reference, candidate, gaps, strict=True)):
        first = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=True)) if a != b), None)
        result.append(Divergence(index, first, None if first is None else gap[first]))
    return result


def load_llm(model: str | None, setting: Setting) -> LLM:
    return LLM(
        model=model,
        mode="continuous",
        dtype=setting.dtype,
        quantization=setting.quantization,
        **STEPS[setting.steps],  # type: ignore[arg-type]
    )


def run(model: str | None, settings: Sequence[Setting], texts: Path, prompts: int, max_tokens: int, chunk: int) -> dict:
    ordered = [Setting.parse(BASELINE), *(s for s in settings if s.name != BASELINE)]
    results: list[SettingResult] = []
    base_logprobs: list[float] = []
    base_outputs: list[list[int]] = []
    gaps: list[list[float]] = []
    greedy_set: list[list[int]] = []
    for setting in ordered:
        with load_llm(model, setting) as llm:
            chunks = reference_chunks(llm, texts, chunk)
            if not greedy_set:
                greedy_set = greedy_prompts(chunks, prompts)
            logprobs = scored_logprobs(llm, chunks)
            outputs = greedy(llm, greedy_set, max_tokens)
            if setting.name == BASELINE:
                base_logprobs, base_outputs = logprobs, outputs
                gaps = top2_gaps(llm, greedy_set, outputs)
        divergences = compare(base_outputs, outputs, gaps)
        results.append(
            SettingResult(
                setting.name,
                perplexity(logprobs),
                perplexity(logprobs) / perplexity(base_logprobs),
                rms_change(logprobs, base_logprobs),
                len(logprobs),
                sum(d.first_difference is None for d in divergences),
                tuple(divergences),
            )
        )
        print(format_row(results[-1], prompts), flush=True)
    return {
        "model": model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
        "texts": str(texts),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "chunk": chunk,
        "tolerance": PPL_TOLERANCE,
        "results": [asdict(r) | {"median_first_difference": r.median_first_difference} for r in results],
    }


def format_row(result: SettingResult, prompts: int) -> str:
    diverged = [d for d in result.divergences if d.first_difference is not None]
    gaps = sorted(d.top2_gap for d in diverged if d.top2_gap is not None)
    verdict = "ok" if result.perplexity_ratio <= 1 + PPL_TOLERANCE else "OVER 1%"
    return (
        f"{result.setting:<18} ppl {result.perplexity:8.3f} ({(result.perplexity_ratio - 1) * 100:+.2f}%, {verdict})"
        f"  log-prob change RMS {result.logprob_rms:.4f}"
        f"  identical {result.identical_prompts}/{prompts}"
        f"  first difference at {[d.first_difference for d in diverged]}"
        f"  float32 top-2 gap there {[round(g, 3) for g in gaps]}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: the SmolLM2 GGUF)")
    parser.add_argument(
        "--settings",
        default="float32/none,bfloat16/none,float32/int8,bfloat16/int4,bfloat16/int4:quantized,"
        "bfloat16/int4:quantized-float",
        help="comma-separated DTYPE/QUANTIZATION[:STEPS] settings (STEPS: "
        + ", ".join(STEPS)
        + "); float32/none is always run first as the baseline",
    )
    parser.add_argument("--texts", type=Path, default=DEFAULT_TEXTS)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/results/quality/<YYYY-MM-DD>-<machine>/result.json"
    )
    args = parser.parse_args(argv)
    out: Path = args.out or dated_result_dir("quality") / "result.json"
    settings = [Setting.parse(s) for s in args.settings.split(",") if s]
    report = run(args.model, settings, args.texts, args.prompts, args.max_tokens, args.chunk)
    write_json(out, report)
    print(f"wrote {out}")
