"""ServerConfig <-> command-line flags, from the dataclass's fields and their `help` metadata: one definition per flag.

Used by `batchserve` (api/cli.py), the Ray Serve entry points (api/scale_out/ray_serve.py) and the benchmarks that
build a server's runtime. `python -m api.flags --markdown` prints the table of `batchserve serve`'s flags that
docs/flags.md holds between its markers (`--write` rewrites that file).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from api.config import API_KEY_ENV, ServerConfig
from scheduler.ranges import Range

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# `batchserve serve`'s one flag that is not a ServerConfig field (api/cli.py adds it; the table lists it too).
REPLICAS = Range(1, 1024, integer=True)
REPLICAS_HELP = (  # the table gives the range and default columns of their own; `--help` adds them (api/cli.py)
    "Replicas behind one endpoint; above 1 starts a local Ray Serve (pip install -e '.[ray]'; see "
    "docs/scale_out.md), each replica with these flags and the machine's CPUs / N threads"
)
REPLICAS_DEFAULT = "(default: 1, no Ray)"
FLAGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
FLAGS_START = "<!-- FLAGS_START -->"
FLAGS_END = "<!-- FLAGS_END -->"


def _base_type(annotation: Any) -> type:
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is tuple:
        return tuple
    return annotation  # type: ignore[no-any-return]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class NumberFlag:
    """A numeric flag's argparse `type`: its text as a value in `bounds`, or argparse's one-line error, which names
    the flag (`argument --x: must be ...`) and exits 2."""

    def __init__(self, bounds: Range) -> None:
        self.bounds = bounds

    def __call__(self, text: str) -> int | float:
        try:
            return self.bounds.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


def _help(f: dataclasses.Field[Any]) -> str:
    help_text: str = f.metadata["help"]
    bounds = f.metadata.get("range")
    if bounds is not None:
        help_text = f"{help_text}; {bounds.span()}"
    if "(default:" not in help_text:  # some fields describe their default themselves
        help_text = f"{help_text} (default: {f.default})"
    return help_text


def add_config_flags(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """One flag per ServerConfig field, with its help text and default."""
    hints = get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        if f.name in skip:
            continue
        kind = _base_type(hints[f.name])
        flag = _flag(f.name)
        if kind is tuple:
            parser.add_argument(flag, nargs="*", default=f.default, help=_help(f))
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=_help(f))
        else:
            bounds = f.metadata.get("range")
            parse: Callable[[str], Any] = NumberFlag(bounds) if bounds is not None else kind
            parser.add_argument(flag, type=parse, default=f.default, choices=f.metadata.get("choices"), help=_help(f))


def flags_argv(values: Mapping[str, Any]) -> list[str]:
    """The inverse of add_config_flags: `name=value` pairs (typed, or strings as `serve run` passes them) as flags;
    a None value is left out, so the flag keeps its default."""
    argv: list[str] = []
    for key, value in values.items():
        flag = _flag(str(key))
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            on = value if isinstance(value, bool) else str(value).lower() == "true"
            argv.append(flag if on else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    values["cors_origins"] = tuple(values.get("cors_origins") or ())
    if values.get("api_key") is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return ServerConfig(**values)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: object) -> str:
    """As the command line takes it: a bool is on or off, None and () are unset (the help says what that means)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == ():
        return "unset"
    return f"`{value}`"


def markdown_table() -> str:
    """Every `batchserve serve` flag as a markdown table (flag, default, range, help), in the order `--help` lists
    them."""
    hints = get_type_hints(ServerConfig)
    rows = ["| flag | default | range | help |", "|---|---|---|---|"]
    for f in dataclasses.fields(ServerConfig):
        kind = _base_type(hints[f.name])
        flag = f"`{_flag(f.name)}`"
        if kind is bool:
            flag = f"`{_flag(f.name)}` / `--no-{f.name.replace('_', '-')}`"
        choices = f.metadata.get("choices")
        text = f.metadata["help"] + (f" (one of: {', '.join(choices)})" if choices else "")
        bounds = f.metadata.get("range")
        span = bounds.span() if bounds is not None else ""
        rows.append(f"| {flag} | {_default(f.default)} | {span} | {_cell(text)} |")
    rows.append(f"| `--replicas` | `1` | {REPLICAS.span()} | {_cell(REPLICAS_HELP)} |")
    return "\n".join(rows) + "\n"


def with_table(doc: str) -> str:
    """`doc` with the text between its FLAGS_START and FLAGS_END markers replaced by the current table."""
    head, start, rest = doc.partition(FLAGS_START)
    _, end, tail = rest.partition(FLAGS_END)
    if not start or not end:
        raise ValueError(f"the doc needs {FLAGS_START} and {FLAGS_END} around the table")
    return f"{head}{start}\n{markdown_table()}{end}{tail}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m api.flags", description="batchserve serve's flags as markdown")
    parser.add_argument("--markdown", action="store_true", help="Print the flags table")
    parser.add_argument("--write", action="store_true", help=f"Rewrite the table in {FLAGS_DOC.name}")
    args = parser.parse_args(argv)
    if args.write:
        FLAGS_DOC.write_text(with_table(FLAGS_DOC.read_text()))
    if args.markdown or not args.write:
        sys.stdout.write(markdown_table())


if __name__ == "__main__":
    main()
