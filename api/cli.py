"""`batchserve serve` (the HTTP server) and `batchserve generate` (one prompt, offline), built from ServerConfig;
`batchserve formats` (api/formats.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import types
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, NoReturn

import uvicorn

from api.config import ServerConfig
from api.flags import (
    LOG_FORMAT,
    REPLICAS,
    REPLICAS_DEFAULT,
    REPLICAS_HELP,
    NumberFlag,
    add_config_flags,
    config_from_args,
)
from api.formats import FORMATS_HELP, add_formats_flags, formats
from engine.config import DTYPES, QUANTIZATIONS
from engine.platform.cpu_features import CpuIsaError, cpu_features
from scheduler.config import Mode
from scheduler.lineup import DEFAULT, SYNTAX, Entry, checked, parse_entry, parse_lineup
from scheduler.ranges import SEATS

# Once the drain is over every request has its answer or its error: this bounds writing them to slow clients.
_WRITE_OUT_S = 5


class _Server(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown.

    uvicorn closes its listeners as soon as it starts shutting down, so the first SIGTERM/SIGINT does not start
    that: the server keeps listening (new requests and /health get 503 with Retry-After) while `drain` lets the
    running requests finish within the grace period and ends the rest; then uvicorn shuts down. A second signal
    cuts the grace period short (`cut_short`): what still runs is ended with a 503 and the shutdown goes on, as
    cleanly. Only a third exits at once, as uvicorn does: without the lifespan's shutdown, so not cleanly.
    """

    def __init__(
        self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]], cut_short: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._cut_short = cut_short
        self._signals = 0
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler interrupts the event loop's thread anywhere (even holding a lock): only set flags here.
        self._signals += 1
        if self._signals > 2:
            super().handle_exit(sig, frame)
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._signals and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        if self._signals == 2:
            self._cut_short()  # idempotent: a flag the drain polls
        if self._drain_task is not None and self._drain_task.done():
            if not self._drain_task.cancelled() and self._drain_task.exception() is not None:
                logging.getLogger("batchserve.api").error("the drain failed", exc_info=self._drain_task.exception())
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, minus re-raising the signal after shutdown (which kills the process with it): a drained
        SIGTERM or SIGINT is a clean exit, status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(config: ServerConfig, lineup: tuple[Entry, ...] | None = None) -> None:
    """`lineup`: those modes side by side on one port (`compare`, api/apps/compare.py); else `config.mode` alone."""
    # Importing torch and transformers takes seconds on a small CPU: say so, the first start is long enough quiet.
    logging.getLogger("batchserve.api").info(
        "loading torch and transformers, then the model (%s)", config.model or "the default, SmolLM2-135M-Instruct"
    )
    from api.apps.compare import create_compare_app, drain_all
    from api.apps.serve import create_app
    from api.endpoints.state import Phase, ServerState
    from api.process.drain import cut_short, drain
    from api.process.server import uvicorn_config

    # this process is the server's alone: its heap is frozen after loading (api.runtime.heap)
    compare = lineup is not None
    if lineup is not None:
        app = create_compare_app(config, freeze_heap=True, lineup=lineup)
    else:
        app = create_app(config, freeze_heap=True)
    uv_config = uvicorn_config(  # connection timeouts and cap, HTTP/2 refusal, throttled accept errors
        app,
        config,
        log_level="warning",
        timeout_graceful_shutdown=_WRITE_OUT_S,  # after the drain (below), which gives the grace period
    )
    state = ServerState.of(app)
    server = _Server(
        uv_config,
        (lambda: drain_all(state)) if compare else (lambda: drain(state, config.shutdown_grace_s)),
        lambda: cut_short(state),
    )

    def announce() -> None:
        state.ready.wait()
        if state.phase is Phase.READY:
            runtime = state.loaded()
            print(
                f"batchserve ready on http://{config.host}:{config.port} "
                f"mode={'+'.join(e.name for e in lineup) if lineup is not None else config.mode} "
                f"model={runtime.model_name} seats={config.seats} (heap frozen: {gc.get_freeze_count():,} objects)",
                flush=True,
            )
        else:
            print("batchserve failed to load the model; see the log above", file=sys.stderr, flush=True)
            server.should_exit = True

    threading.Thread(target=announce, daemon=True).start()
    server.run()
    if state.phase is Phase.FAILED:
        raise SystemExit("batchserve: the model could not be loaded")
    loading = state.phase is Phase.LOADING
    if loading:
        logging.getLogger("batchserve.api").info("stopped while loading the model")
    print("batchserve stopped", flush=True)  # what became of the running requests is logged above
    if loading:
        # The loader thread is still inside torch (converting, or measuring the weight formats for minutes at a
        # first start): finalising the interpreter under it aborts in C++ ("terminate called without an active
        # exception", status 134). Nothing it holds needs keeping; the format cache is written by rename.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(0)


def generate(args: argparse.Namespace) -> None:
    from api.runtime.offline import LLM
    from engine.sample.sampling_params import SamplingParams

    llm = LLM(
        model=args.model,
        mode=Mode.CONTINUOUS.value,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for output in llm.generate([args.prompt], params, chat=args.chat):
        print(output.text)
    llm.close()


def compare_config(args: argparse.Namespace) -> ServerConfig:
    """`batchserve compare`'s flags: `--seats N` sets every mode's seats; each mode takes its own flags."""
    if args.seats is not None:
        args.max_batch_size = args.max_num_seqs = args.seats
    return config_from_args(args)


def compare_lineup(args: argparse.Namespace) -> tuple[Entry, ...]:
    """`--modes` (a `<mode>-spec` pane: that mode with --speculative-config), and `--policy` as one more pane;
    ValueError naming what is wrong."""
    entries = list(parse_lineup(args.modes, speculation=True))
    if args.policy is not None:
        entries.append(parse_entry(args.policy, speculation=True))
    speculating = [e.name for e in entries if e.speculative]
    if speculating and args.speculative_config is None:
        raise ValueError(f"the pane {speculating[0]} speculates: give --speculative-config")
    return checked(entries)


class _Parser(argparse.ArgumentParser):
    """argparse, whose error is one line naming the flag (`batchserve serve: error: argument --x: ...`), exit 2,
    without the usage: `serve`'s runs to 30 lines and buried the error under them."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: `compare --mode dynamic` would otherwise load a model named "dynamic" (--model).
    parser = _Parser(
        prog="batchserve", description="An LLM server for A/B testing batching policies", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,compare,generate,formats}")
    serve_parser = commands.add_parser("serve", help="Start the OpenAI-compatible HTTP server", allow_abbrev=False)
    add_config_flags(serve_parser)
    replicas_help = f"{REPLICAS_HELP}; {REPLICAS.span()} {REPLICAS_DEFAULT}"
    serve_parser.add_argument("--replicas", type=NumberFlag(REPLICAS), default=1, help=replicas_help)
    compare = commands.add_parser(
        "compare", help="Serve batching modes side by side on one port, with the live page", allow_abbrev=False
    )
    compare.add_argument(
        "--modes",
        default=DEFAULT,
        help=f"The panes: {SYNTAX}, each under /NAME (default: {DEFAULT}); <mode>-spec: that mode with "
        "--speculative-config (then the panes without -spec run without it; with none, every pane has it)",
    )
    compare.add_argument("--policy", default=None, help="One more pane: a plug-in policy [NAME=]MODULE:CLASS")
    add_config_flags(compare, skip=("mode", "policy"))
    seats_help = f"Seats of every mode (sets the two flags above); {SEATS.span()}"
    compare.add_argument("--seats", type=NumberFlag(SEATS), default=None, help=seats_help)
    gen = commands.add_parser("generate", help="Generate one completion offline and print it", allow_abbrev=False)
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="Checkpoint directory or .gguf (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    gen.add_argument("--dtype", default="auto", choices=DTYPES, help="as `serve --dtype`")
    gen.add_argument("--quantization", default="auto", choices=QUANTIZATIONS, help="as `serve --quantization`")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="Wrap the prompt in the model's chat template")
    add_formats_flags(commands.add_parser("formats", help=FORMATS_HELP, allow_abbrev=False))
    return parser


def _exit_before_serving(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # Until the server installs its own handlers (and drains), SIGTERM means "never mind": exit quietly, with 0.
    signal.signal(signal.SIGTERM, _exit_before_serving)
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "compare"):  # and Ctrl-C too: not a KeyboardInterrupt traceback from an import
        signal.signal(signal.SIGINT, _exit_before_serving)
    try:
        logging.getLogger("batchserve.api").info("CPU: %s", cpu_features().describe())
    except CpuIsaError as exc:  # a bad BATCHSERVE_CPU_ISA: one line, before anything loads
        raise SystemExit(f"batchserve: {exc}") from None
    if args.command == "serve":
        try:
            config = config_from_args(args)
        except ValueError as exc:
            raise SystemExit(f"batchserve: {exc}") from None
        if args.replicas > 1:  # only then is Ray imported: the single server never loads it
            from api.scale_out.ray_serve import ScaleOut, serve_replicas

            serve_replicas(config, ScaleOut.on_this_machine(args.replicas))
        else:
            serve(config)
    elif args.command == "compare":
        try:
            config, lineup = compare_config(args), compare_lineup(args)
        except ValueError as exc:
            raise SystemExit(f"batchserve: {exc}") from None
        serve(config, lineup)
    elif args.command == "formats":
        formats(args)
    else:
        generate(args)
