"""One weight format across an A/B's batchserve servers: each resolves `auto` itself, and while the machine's choice
is provisional (a busy machine, api/runtime/format_probe.py) two starts can pick different formats, which would turn
a comparison of modes into one of formats. When the first server's choice is provisional, its format, read from its
log's `weights:` line, is passed explicitly (--dtype, --quantization) to every later one, for whatever the user left
to `auto`. A settled choice is not pinned: every later start reads the same cached entry, row switch and one-digit
steps included, which explicit flags would replace with the default switch and no one-digit steps (as they do for
the servers after a provisional first one)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.targets import Target

# The loader's and the probe's line naming the format served ("weights: int4/float32, chosen by auto ...").
_SERVED = re.compile(r"weights: (?:(int4|int8)/)?(float32|bfloat16)\b")
_FLAGS = ("--dtype", "--quantization")


@dataclass(frozen=True)
class Pin:
    dtype: str | None  # None: the user's own --dtype stays
    quantization: str | None
    source: str  # the server whose `auto` resolved it

    def flags(self) -> list[str]:
        values = (self.dtype, self.quantization)
        return [part for flag, value in zip(_FLAGS, values, strict=True) if value for part in (flag, value)]


def is_batchserve(target: Target) -> bool:
    return tuple(target.argv[1:4]) == ("-m", "api", "serve")


def provisional(log: Path) -> bool:
    """Whether the server's `auto` choice was provisional (the probe's "chosen by auto provisionally" line)."""
    try:
        return "chosen by auto provisionally" in log.read_text(errors="replace")
    except OSError:
        return False


def served_format(log: Path) -> tuple[str, str] | None:
    """The (dtype, quantization) a batchserve server's log says it serves (its last `weights:` line); None if none."""
    try:
        found = _SERVED.findall(log.read_text(errors="replace"))
    except OSError:
        return None
    return (found[-1][1], found[-1][0] or "none") if found else None


def pin_from(served: tuple[str, str], source: str, dtype: str | None, quantization: str | None) -> Pin | None:
    """The pin for what the user left open (`dtype`, `quantization`: their flags; None or auto is open)."""
    open_dtype, open_quantization = dtype in (None, "auto"), quantization in (None, "auto")
    if not (open_dtype or open_quantization):
        return None
    return Pin(served[0] if open_dtype else None, served[1] if open_quantization else None, source)


def pinned(target: Target, pin: Pin) -> Target:
    """`target` with the pinned flags in place of any `auto` it had."""
    argv, pinning, index = [], {flag for flag in pin.flags() if flag.startswith("--")}, 0
    while index < len(target.argv):
        if target.argv[index] in pinning:
            index += 2
            continue
        argv.append(target.argv[index])
        index += 1
    return dataclasses.replace(target, argv=(*argv, *pin.flags()))
