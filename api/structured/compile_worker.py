"""A grammar compile worker: `python -m api.structured.compile_worker`, started by api/structured/grammars.py.

It reads its setup, then one spec at a time from stdin, and answers each with the compiled grammar serialized (or
an error message) on stdout, in api/structured/compile_pool.py's frames. It runs at the lowest CPU priority: a
compile waits for a core the engine does not want. It ends when its stdin does (the server exited or killed it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys


def main() -> None:
    os.nice(19)
    # Imported after lowering the priority: importing xgrammar (and the torch it imports) is most of a start.
    from api.structured.compile_pool import FAILED, OK, read_frame, write_frame
    from api.structured.spec import GrammarCompileError, GrammarKind, GrammarSpec
    from api.structured.xgrammar_backend import XGrammarCompiler

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = read_frame(stdin)
    if setup is None:
        return
    compiler = XGrammarCompiler.from_setup(setup)
    write_frame(stdout, OK)  # ready: the server starts a job's deadline only now
    while (request := read_frame(stdin)) is not None:
        fields = json.loads(request)
        spec = GrammarSpec(GrammarKind(fields["kind"]), fields["text"], fields["param"])
        try:
            answer = OK + compiler.compile_bytes(spec)
        except GrammarCompileError as exc:
            answer = FAILED + str(exc).encode()
        write_frame(stdout, answer)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):  # the server left or killed it: nothing to say
        main()
