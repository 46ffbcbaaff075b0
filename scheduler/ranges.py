"""The range of a numeric setting: finite, never a denormal, between two bounds. One definition serves a config
dataclass's `__post_init__` (a ValueError naming the field) and its command-line flag (api/flags.py turns the same
refusal into argparse's one-line error naming the flag).

Every bound is finite on purpose: a timeout of 1e13 ms overflowed the loop thread's wait and killed it, a window
of 1e-320 ms overflowed the tick arithmetic, and NaN compares false with everything, so a check written as
`x < 0` let it through to a loop that then waited forever.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

DAY_S = 86_400.0  # the longest any timeout or grace period may be: longer is a typo, not a setting
DAY_MS = DAY_S * 1000  # the longest a batch may wait for its timeout or its window


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    integer: bool = False
    low_open: bool = False  # `low` itself is refused: the value must be above it

    def span(self) -> str:
        if self.low_open:
            return f"above {_number(self.low)} and at most {_number(self.high)}"
        return f"from {_number(self.low)} to {_number(self.high)}"

    def describe(self) -> str:
        return f"{'an integer' if self.integer else 'a number'} {self.span()}"

    def refusal(self, value: object) -> str | None:
        """Why `value` is not in the range, or None if it is."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"got {value!r}, which is not a number"
        if self.integer and not isinstance(value, int):
            return f"got {value!r}, which is not an integer"
        if isinstance(value, float) and not math.isfinite(value):
            return f"got {value!r}"
        if isinstance(value, float) and 0 < abs(value) < sys.float_info.min:
            return f"got {value!r}, a denormal number"
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high:
            return f"got {value!r}"
        return None

    def check(self, name: str, value: object) -> None:
        """ValueError naming `name` unless `value` is in the range."""
        refusal = self.refusal(value)
        if refusal is not None:
            raise ValueError(f"{name} must be {self.describe()}, {refusal}")

    def parse(self, text: str) -> int | float:
        """A flag's text as a value in the range; ValueError saying what is wrong (without the flag's name)."""
        try:
            value: int | float = int(text) if self.integer else float(text)
        except ValueError:
            raise ValueError(f"must be {self.describe()}, got {text!r}") from None
        refusal = self.refusal(value)
        if refusal is not None:
            raise ValueError(f"must be {self.describe()}, {refusal}")
        return value


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


# Sizes shared by the scheduler's config, the server's and the command line.
SEATS = Range(1, 4096, integer=True)
QUEUE = Range(1, 1_000_000, integer=True)
TIMEOUT_S = Range(0, DAY_S, low_open=True)
