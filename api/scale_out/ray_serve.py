"""batchserve as a Ray Serve application: N replicas, each the app of `batchserve serve` (one engine, one scheduler,
the same flags), behind Ray's HTTP proxy. The only module that imports Ray; the single server never loads it.

Two ways in (docs/scale_out.md):
- `batchserve serve --replicas N ...` starts a local Ray instance and the application (`serve_replicas`);
- `serve run` / `serve deploy` with the builder `api.scale_out.ray_serve:build_app` join an existing cluster.

Routing is Ray Serve's default (power of two choices on ongoing requests); a replica takes at most its seats plus
its queue (plus a small margin), so a full replica answers 429 with Retry-After itself, before Ray's router would
queue the request. A small directory deployment collects each replica's heartbeat and metrics, for /health's count
of ready replicas and a /metrics that shows every replica's series.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from api.config import ServerConfig
from api.endpoints.state import Phase, ServerState
from api.flags import LOG_FORMAT, add_config_flags, config_from_args, flags_argv
from api.scale_out.replica_asgi import HEARTBEAT_S, ReplicaApp, ReplicaReport, report_of

logger = logging.getLogger("batchserve.api")

APP_NAME = "batchserve"
REPLICA_DEPLOYMENT = "BatchserveReplica"
DIRECTORY_DEPLOYMENT = "BatchserveDirectory"
# Ray reads this in the proxy process: it adds ProxyFaultMiddleware there (set before Ray starts; see the docs).
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "api.scale_out.proxy_faults:proxy_middlewares"
# Ray runs a replica's user code on its own thread and event loop by default, so every streamed chunk crosses
# threads (and the GIL) once more on its way to the proxy. Our app never blocks its loop (the engine steps on its own
# thread), so replicas run it on Ray's loop unless the deployment's environment says otherwise: measured on 2 cores,
# median light-load TTFT +6.3 ms and 0.87x throughput against the plain server over eight rounds, from +22.7 ms
# and 0.85x (docs/scale_out.md).
REPLICA_THREAD_ENV = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
# A local Ray instance sets two more before it starts, so that every process it starts inherits them (a caller's own
# value wins; on a cluster, set them on `ray start`): the proxy's router runs on the proxy's own loop (one thread hop
# and GIL handover less per request), and Ray's worker processes keep the normal CPU priority instead of
# lowering it to niceness 15. A replica holds the engine: at niceness 15 on a machine without a spare core, the
# benchmark client, Ray's raylet and GCS take the cores from it first.
LOCAL_RAY_ENV = MappingProxyType({"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0", "RAY_worker_niceness": "0"})
# Requests in a replica's hands that its scheduler has not submitted yet (reading, tokenising): without room for
# them the router, not the replica, would be the one to refuse.
_ROUTING_MARGIN = 2
_FORGET_AFTER_S = 60.0


@dataclass(frozen=True)
class ScaleOut:
    """How many replicas and what each one reserves; every replica runs the same ServerConfig."""

    replicas: int = 2
    cpus_per_replica: float = 1.0  # also its torch threads (at least one)
    gpus_per_replica: float = 0.0  # 1 with --device cuda: one replica per GPU

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0")

    @classmethod
    def on_this_machine(cls, replicas: int, cpus_per_replica: float | None = None, gpus: float = 0.0) -> ScaleOut:
        """`cpus_per_replica` None: the machine's CPUs shared evenly (at least one each)."""
        if cpus_per_replica is None:
            cpus_per_replica = float(max(1, (os.cpu_count() or 1) // max(1, replicas)))
        return cls(replicas, cpus_per_replica, gpus)

    @property
    def torch_threads(self) -> int:
        return max(1, int(self.cpus_per_replica))


def max_ongoing_requests(config: ServerConfig) -> int:
    """What Ray's router lets one replica hold: its seats plus its queue, so its own 429 comes first."""
    return config.seats + config.max_queue + _ROUTING_MARGIN


@serve.deployment(
    name=DIRECTORY_DEPLOYMENT,
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},
)
class BatchserveDirectory:
    """The latest report of every replica: who is ready, its process id, its metrics."""

    def __init__(self) -> None:
        self._reports: dict[str, ReplicaReport] = {}

    def put(self, report: ReplicaReport) -> None:
        self._reports[report.replica] = report

    def reports(self) -> list[ReplicaReport]:
        # Forget the long dead (a restarted replica has a new name); readiness itself is judged by the reader.
        now = time.time()
        self._reports = {k: r for k, r in self._reports.items() if now - r.sent_at < _FORGET_AFTER_S}
        return list(self._reports.values())


def log_to_stderr(logger: logging.Logger) -> None:
    """`logger`'s info lines and up on stderr, in the driver's format, once however often it is called."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # one copy of each line, whatever the worker's root logger does


@serve.deployment(name=REPLICA_DEPLOYMENT)
@serve.ingress()
class BatchserveReplica:
    """One replica: the Starlette app of `batchserve serve` built from the same ServerConfig."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self, config: ServerConfig, torch_threads: int, directory: DeploymentHandle
    ) -> None:
        import torch  # here, not at import: `serve run` builds the application without loading a model

        from api.apps.serve import create_app

        # A Ray worker has no handler for our loggers, so their info lines (threads, the heap freeze) went nowhere;
        # on stderr, Ray files them with the replica's logs and shows them on the driver's console.
        log_to_stderr(logging.getLogger("batchserve"))
        torch.set_num_threads(torch_threads)
        self._directory = directory
        self._name = serve.get_replica_context().replica_id.unique_id
        self._app = create_app(config, freeze_heap=True)  # a replica's process is its own
        ServerState.of(self._app).replica = self._name
        self._heartbeat: asyncio.Task[None] | None = None
        user_thread = os.environ.get(REPLICA_THREAD_ENV, "1") == "1"  # Ray's own default, where unset
        logger.info(
            "replica %s: %d torch threads, requests served on %s",
            self._name,
            torch_threads,
            "a thread of their own" if user_thread else "Ray's event loop",
        )

    async def __serve_build_asgi_app__(self) -> ReplicaApp:
        self._heartbeat = asyncio.ensure_future(self._beat())
        return ReplicaApp(self._app, self._name, os.getpid(), self._peer_reports)

    async def _peer_reports(self) -> list[ReplicaReport]:
        reports: list[ReplicaReport] = await self._directory.reports.remote()
        return reports

    async def _beat(self) -> None:
        while True:
            report = report_of(self._app, self._name, os.getpid())
            if report is not None:
                try:
                    await self._directory.put.remote(report)
                except Exception:  # the directory restarts with its deployment; the next beat finds it
                    logger.warning("replica %s: heartbeat failed", self._name, exc_info=True)
            await asyncio.sleep(HEARTBEAT_S)

    def check_health(self) -> None:
        """Ray calls this periodically; raising makes it replace the replica."""
        state = ServerState.of(self._app)
        if state.phase is Phase.FAILED or (state.phase is Phase.READY and not state.serving):
            raise RuntimeError(f"replica {self._name} is not serving ({state.loop_stopped or state.phase.value})")


def replica_actor_options(scale: ScaleOut) -> dict[str, Any]:
    """Each replica's resources, and its request thread setting (REPLICA_THREAD_ENV: ours unless the caller's)."""
    return {
        "num_cpus": scale.cpus_per_replica,
        "num_gpus": scale.gpus_per_replica,
        "runtime_env": {"env_vars": {REPLICA_THREAD_ENV: os.environ.get(REPLICA_THREAD_ENV, "0")}},
    }


def application(config: ServerConfig, scale: ScaleOut) -> serve.Application:
    """The Ray Serve application: `scale.replicas` replicas of `config`'s server and their directory."""
    replica = BatchserveReplica.options(  # type: ignore[attr-defined]  # the decorators make it a Deployment
        num_replicas=scale.replicas,
        max_ongoing_requests=max_ongoing_requests(config),
        ray_actor_options=replica_actor_options(scale),
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        # Ray's SIGTERM to a replica runs the app's lifespan shutdown, i.e. the server's drain.
        graceful_shutdown_timeout_s=config.shutdown_grace_s + 5.0,
        logging_config={"enable_access_log": False},  # one line per request and per heartbeat otherwise
    )
    directory = BatchserveDirectory.bind()  # type: ignore[attr-defined]
    return replica.bind(config, scale.torch_threads, directory)  # type: ignore[no-any-return]


def _scale_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=ScaleOut.replicas, help="Replicas of the server")
    parser.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        help="CPUs each replica reserves, and its torch threads (default: the machine's CPUs / replicas)",
    )
    parser.add_argument(
        "--gpus-per-replica", type=float, default=ScaleOut.gpus_per_replica, help="GPUs each replica reserves"
    )


def scale_from_args(args: argparse.Namespace) -> ScaleOut:
    return ScaleOut.on_this_machine(args.replicas, args.cpus_per_replica, args.gpus_per_replica)


def parse(argv: Sequence[str]) -> tuple[ServerConfig, ScaleOut]:
    """`batchserve serve`'s flags plus the scale-out ones; ValueError or SystemExit (argparse) on bad input."""
    parser = argparse.ArgumentParser(prog="batchserve serve --replicas N", allow_abbrev=False)
    add_config_flags(parser)
    _scale_flags(parser)
    args = parser.parse_args(list(argv))
    return config_from_args(args), scale_from_args(args)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The builder for `serve run api.scale_out.ray_serve:build_app key=value ...` and a config file's `import_path`:
    `args` are `batchserve serve`'s flags with underscores (mode, max_num_seqs, model ...) plus replicas,
    cpus_per_replica and gpus_per_replica. `host` and `port` are the proxy's, set in `http_options`."""
    config, scale = parse(flags_argv(args))
    return application(config, scale)


def start_local_ray(num_cpus: int, log_to_driver: bool = True, attempts: int = 3) -> None:
    """A local Ray instance whose processes add the proxy's fault middleware and take LOCAL_RAY_ENV's settings
    (the caller's environment wins). Ray gives its raylet a fixed 30 s to register; on a machine busy enough to
    miss that, the start is tried again."""
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # before Ray starts: its processes inherit it
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=log_to_driver,  # the replicas' logs on this console
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for the timeout
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            logger.warning("Ray's node did not start in time (attempt %d of %d); trying again", attempt, attempts)
            ray.shutdown()


def serve_replicas(config: ServerConfig, scale: ScaleOut) -> None:
    """`batchserve serve --replicas N`: a local Ray instance, the application on config's address, until a signal."""
    needed = scale.replicas * scale.cpus_per_replica
    start_local_ray(max(os.cpu_count() or 1, math.ceil(needed)))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(application(config, scale), name=APP_NAME, route_prefix="/")
        print(
            f"batchserve ready on http://{config.host}:{config.port} mode={config.mode} replicas={scale.replicas} "
            f"seats={config.seats} per replica (Ray Serve)",
            flush=True,
        )
        stop.wait()
    finally:
        serve.shutdown()  # each replica drains, as one server does on SIGTERM
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m api.scale_out.ray_serve --replicas N [serve flags]`: also with one replica, to measure
    the proxy's cost."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        config, scale = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        raise SystemExit(f"batchserve: {exc}") from None
    serve_replicas(config, scale)


if __name__ == "__main__":
    main()
