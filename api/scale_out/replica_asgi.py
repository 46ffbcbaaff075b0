"""The app as one of several replicas behind a proxy: the replica's ASGI wrapper, without Ray
(see api.scale_out.ray_serve).

`ReplicaApp` wraps one replica's Starlette app: its startup completes only once the model is loaded (so the proxy
routes nothing to a loading replica), `/health` adds how many replicas are ready, and `/metrics` answers with
every ready replica's series, each labelled `replica`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.endpoints.merge_metrics import LabelledMerge, exposition
from api.endpoints.state import Phase, ServerState

logger = logging.getLogger("batchserve.api")

# A replica reports every HEARTBEAT_S; one silent for STALE_AFTER_S is dead or hung and no longer counted ready.
# Generous: on a loaded 2-core machine a live replica's heartbeat was seen more than 3 s late, and /health then
# undercounted a serving replica (a load balancer reading it would have drained a healthy one).
HEARTBEAT_S = 1.0
STALE_AFTER_S = 10.0 * HEARTBEAT_S
_DIRECTORY_TIMEOUT_S = 2.0  # /health and /metrics never wait longer on the peers' reports


@dataclass(frozen=True)
class ReplicaReport:
    """What a ready replica tells its peers: who it is, its process, and its Prometheus text."""

    replica: str
    pid: int
    metrics: bytes
    sent_at: float  # time.time(): comparable across processes on one host, roughly across hosts

    def fresh(self, now: float) -> bool:
        return now - self.sent_at < STALE_AFTER_S


def report_of(app: Starlette, replica: str, pid: int) -> ReplicaReport | None:
    """This replica's report, or None while it is not serving (loading, draining, its loop dead)."""
    state = ServerState.of(app)
    if not state.serving:
        return None
    return ReplicaReport(replica, pid, state.loaded().metrics.render(), time.time())


def merge_metrics(reports: Iterable[ReplicaReport]) -> bytes:
    """One exposition text of every replica's series with a `replica` label; totals are `sum without (replica)`."""
    reports = list(reports)
    ready = Metric("batchserve:replicas_ready", "Replicas that reported ready in the last seconds", "gauge")
    ready.add_sample("batchserve:replicas_ready", {}, float(len(reports)))
    sources = ((r.replica, text_string_to_metric_families(r.metrics.decode())) for r in reports)
    return exposition(LabelledMerge(sources, "replica", leading=[ready]))


PeerReports = Callable[[], Awaitable[list[ReplicaReport]]]


async def _captured(app: ASGIApp, scope: Scope, receive: Receive) -> tuple[Message, bytes]:
    """Run a small, non-streaming request through `app` and keep its response: (start message, body)."""
    start: Message = {}
    body = bytearray()

    async def send(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))

    await app(scope, receive, send)
    return start, bytes(body)


async def _send_replaced(send: Send, start: Message, body: bytes) -> None:
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ReplicaApp:
    """One replica's ASGI app: the Starlette app, plus readiness at startup and cluster-wide /health and /metrics.

    `peers` returns the latest reports of every replica (this one's included); reports older than
    STALE_AFTER_S are left out.
    """

    def __init__(self, app: Starlette, replica: str, pid: int, peers: PeerReports) -> None:
        self.app = app
        self.replica = replica
        self.pid = pid
        self._peers = peers

    async def _fresh_reports(self) -> list[ReplicaReport]:
        now = time.time()
        own = report_of(self.app, self.replica, self.pid)
        try:
            peers = await asyncio.wait_for(self._peers(), _DIRECTORY_TIMEOUT_S)
            reports = [r for r in peers if r.replica != self.replica and r.fresh(now)]
        except Exception:  # the directory is slow or restarting: this replica's own view is still worth answering
            logger.warning("the replica directory did not answer; reporting this replica alone", exc_info=True)
            reports = []
        return sorted([own, *reports] if own is not None else reports, key=lambda r: r.replica)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._startup_when_ready(send))
            return
        path = scope["path"] if scope["type"] == "http" and scope["method"] == "GET" else None
        if path == "/health":
            await self._health(scope, receive, send)
        elif path == "/metrics":
            await self._metrics(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _startup_when_ready(self, send: Send) -> Send:
        """Hold the lifespan's startup.complete until the model is loaded; a failed load fails the startup."""

        async def send_when_ready(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                state = ServerState.of(self.app)
                await asyncio.to_thread(state.ready.wait)
                if state.phase is not Phase.READY:
                    message = {"type": "lifespan.startup.failed", "message": "the model could not be loaded"}
            await send(message)

        return send_when_ready

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        start, body = await _captured(self.app, scope, receive)
        if start.get("status") == 200:
            reports = await self._fresh_reports()
            document = json.loads(body)
            document["replica"] = self.replica
            document["replicas"] = {"ready": len(reports), "ids": [r.replica for r in reports]}
            body = json.dumps(document).encode()
        await _send_replaced(send, start, body)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        start, body = await _captured(self.app, scope, receive)  # keeps the API key check and the 503s
        if start.get("status") == 200:
            body = merge_metrics(await self._fresh_reports())
        await _send_replaced(send, start, body)
