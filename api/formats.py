"""`batchserve formats`: the weight formats `auto` chose on this machine (api/runtime/format_choice.py), one entry per
model and set of candidates, with each candidate's figures; `--reprobe` measures a model's choice again now.

torch and transformers are imported when the command runs, not with the parser: `batchserve serve --help` stays
quick."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import DTYPES, QUANTIZATIONS

if TYPE_CHECKING:
    from api.runtime.format_choice import CacheEntry

FORMATS_HELP = "Show the weight formats `auto` chose on this machine, or measure one again"


def add_formats_flags(formats: argparse.ArgumentParser) -> None:
    formats.add_argument(
        "--reprobe",
        action="store_true",
        help="Measure --model's formats again now (replacing its cached choice), then show the choices",
    )
    formats.add_argument("--model", default=None, help="With --reprobe: the model (default: SmolLM2-135M-Instruct)")
    formats.add_argument("--dtype", default="auto", choices=DTYPES, help="With --reprobe: as `serve --dtype`")
    formats.add_argument(
        "--quantization", default="auto", choices=QUANTIZATIONS, help="With --reprobe: as `serve --quantization`"
    )


def describe(path: Path, entry: CacheEntry | None) -> str:
    """One cached choice, a few lines: its file, the model, the format and its lead, every candidate's figures,
    when and where it was measured, and the machine's speed then."""
    if entry is None:
        return f"{path}\n  unreadable, or an older version's: the next start with auto measures again"
    choice = entry.choice
    speed = ", ".join(f"{name} {ms:.2f} ms" for name, ms in choice.calibration_ms.items())
    return "\n".join(
        [
            str(path),
            f"  model     {entry.model}",
            f"  chosen    {choice.summary()}"
            + (
                " (provisional: measured again at the next start, settled once two agree)" if choice.provisional else ""
            ),
            f"  figures   {choice.reason}; best of {choice.rounds} rounds, {choice.quiet_rounds} quiet",
            f"  measured  {entry.measured_at}, {entry.machine}",
            f"  speed     {speed} (calibration; measured again where a later start's compute differs)",
        ]
    )


def formats(args: argparse.Namespace) -> None:
    from api.runtime.format_choice import CHOICE_DIR, cached_entries
    from api.runtime.format_probe import load_auto
    from engine.weights.checkpoints import resolve_cache_dir

    if args.reprobe:
        load_auto(args.model, dtype=args.dtype, quantization=args.quantization, reprobe=True)
    cache = resolve_cache_dir()
    entries = cached_entries(cache)
    if not entries:
        print(f"no weight-format choice cached in {cache / CHOICE_DIR}: `auto` on a CPU measures one at the next start")
    else:
        print("\n\n".join(describe(path, entry) for path, entry in entries))
