"""A line-up of policies run side by side: `batchserve compare --modes`, `python -m benchmarks ab --modes` and
`python -m benchmarks simulate --mode` read the same list.

Each entry is a built-in mode (`static`, `dynamic`, `continuous`) or a plug-in policy, `[NAME=]MODULE:CLASS`. A
plug-in runs with the seats and settings of the mode its class declares (`Policy.mode`; continuous if it declares
none), and is shown under NAME: the pane's title and URL prefix, the run's name, the `mode` label of its metrics.
Without NAME it is the class name in kebab case (`ShortestPromptFirst` -> `shortest-prompt-first`).

Where a line-up takes speculation per entry (`batchserve compare`'s panes: `parse_lineup(text, speculation=True)`),
`<mode>-spec` is that mode with `--speculative-config`, as `ab --speculation both` names its runs, and so is a
plug-in whose NAME ends in `-spec`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from scheduler.config import Mode
from scheduler.policies import load_policy

BUILT_IN = (Mode.STATIC.value, Mode.DYNAMIC.value, Mode.CONTINUOUS.value)  # what `all` means, in this order
DEFAULT = "dynamic,continuous"
_NAME = re.compile(r"[a-z][a-z0-9-]{0,39}")
# A name is a URL prefix beside the compare server's own routes: these would shadow them (or they it).
_RESERVED = frozenset({"v1", "health", "metrics"})
SYNTAX = "a comma list of static, dynamic, continuous (or all) and plug-in policies [NAME=]MODULE:CLASS"
SPEC_SUFFIX = "-spec"  # an entry that speculates: compare's panes, ab's and simulate's runs with --speculation both


@dataclass(frozen=True)
class Entry:
    name: str  # the label everywhere: pane title and prefix, run name, metrics' `mode` label
    mode: Mode  # the built-in mode whose seats and settings it runs with
    policy: str | None = None  # a plug-in Policy subclass by import path, run instead of the mode's own
    speculative: bool = False  # runs with --speculative-config (a pane named <mode>-spec)

    @property
    def description(self) -> str:
        return self.name if self.policy is None else f"{self.name} ({self.policy}, {self.mode.value}'s seats)"


def parse_entry(text: str, speculation: bool = False) -> Entry:
    """One entry; ValueError naming what is wrong (a policy that does not load included). `speculation`: a name
    ending in -spec speculates."""
    text = text.strip()
    if text in BUILT_IN:
        return Entry(text, Mode(text))
    base = text.removesuffix(SPEC_SUFFIX)
    if speculation and base != text and base in BUILT_IN:
        return Entry(text, Mode(base), speculative=True)
    name, _, path = text.rpartition("=")
    if ":" not in path:
        raise ValueError(f"{text!r} is neither a mode ({', '.join(BUILT_IN)}) nor a policy [NAME=]MODULE:CLASS")
    policy_class = load_policy(path)
    mode = getattr(policy_class, "mode", Mode.CONTINUOUS)
    name = name.strip() or _kebab(policy_class.__name__)
    if not _NAME.fullmatch(name) or name in _RESERVED or name in BUILT_IN:
        raise ValueError(
            f"the policy's name {name!r} must be lower-case letters, digits and dashes, start with a letter, and "
            f"not be {', '.join(sorted(_RESERVED | set(BUILT_IN)))}; give one as NAME={path}"
        )
    speculative = speculation and name.endswith(SPEC_SUFFIX)
    return Entry(name, mode if isinstance(mode, Mode) else Mode(mode), path, speculative)


def parse_lineup(text: str, speculation: bool = False) -> tuple[Entry, ...]:
    """A comma list of entries; `all` stands for the three built-in modes. No name twice. `speculation`: as
    `parse_entry`'s."""
    entries: list[Entry] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        entries += [Entry(m, Mode(m)) for m in BUILT_IN] if part == "all" else [parse_entry(part, speculation)]
    return checked(entries)


def checked(entries: list[Entry]) -> tuple[Entry, ...]:
    if not entries:
        raise ValueError(f"no modes given: expected {SYNTAX}")
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} appear(s) twice; each entry needs its own name (NAME=MODULE:CLASS)")
    return tuple(entries)


def _kebab(class_name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "-", class_name).lower()
