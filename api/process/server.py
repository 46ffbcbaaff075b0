"""The uvicorn configuration of a batchserve server: the guarded connection protocol and the quiet event loop."""

from __future__ import annotations

import resource
from typing import Any

import uvicorn

from api.config import ServerConfig
from api.process.connections import ConnectionLimits, protocol_class

# Headroom for the model files, the engine's threads and everything else the process opens besides sockets.
_MAX_CONNECTIONS_CEILING = 1024


def default_max_connections() -> int:
    """min(1024, half the soft descriptor limit): a connection flood is refused before descriptors run out."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _MAX_CONNECTIONS_CEILING
    return max(1, min(_MAX_CONNECTIONS_CEILING, soft // 2))


def connection_limits(config: ServerConfig) -> ConnectionLimits:
    return ConnectionLimits(
        header_timeout_s=config.header_timeout_s,
        request_read_timeout_s=config.request_read_timeout_s,
        max_connections=config.max_connections or default_max_connections(),
    )


def uvicorn_config(app: Any, config: ServerConfig, **options: Any) -> uvicorn.Config:
    """uvicorn.Config for `app` on `config`'s address with batchserve's connection handling; `options` are passed
    through (log level, graceful shutdown)."""
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=protocol_class(connection_limits(config)),
        loop="api.process.asyncio_loop:new_event_loop",
        timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn takes a float too
        **options,
    )
