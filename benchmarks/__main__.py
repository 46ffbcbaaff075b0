"""`python -m benchmarks <command> [args]`: one entry point for every benchmark (table in benchmarks/commands.py)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from benchmarks.commands import BY_NAME, COMMANDS

USAGE = "usage: python -m benchmarks <command> [args]   (python -m benchmarks <command> --help for its flags)"


def usage() -> str:
    width = max(len(c.name) for c in COMMANDS)
    rows = "\n".join(f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS)
    return f"{USAGE}\n\ncommands:\n{rows}\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if args else 2
    command = BY_NAME.get(args[0])
    if command is None:
        print(f"unknown command {args[0]!r}\n\n{usage()}", end="", file=sys.stderr)
        return 2
    result = importlib.import_module(command.module).main(args[1:])
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
