"""Connection hygiene on top of uvicorn's h11 protocol: what a slow, idle, excess or foreign client gets.

- Idle (no request in flight, no byte of the next one, a fresh connection too): closed after the keep-alive
  timeout. uvicorn arms that timer only after a response, so a connection that never sent anything stayed open.
- The head of a request must be complete `header_timeout_s` after its first byte, and its body
  `request_read_timeout_s` after the head. Trickling bytes does not move the deadline. Past it: 408, closed.
- Past `max_connections` open connections a new one gets 503 with Retry-After at once and is closed, so a flood
  of idle sockets cannot take every file descriptor.
- An HTTP/2 preface gets one 505 instead of uvicorn's 404 then 400.
- A malformed request (a bad chunk size, a broken head) gets an OpenAI-shaped 400, and uvicorn's protocol warnings
  about client faults are logged at INFO: a client must not be able to fill the log.

All these answers are written below h11 and end the connection: each says `connection: close`, the write side is
shut, and what the client still sends is read and dropped for `LINGER_S`, so that closing with unread input (which
makes the kernel send a reset) does not destroy the answer before the client reads it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar, Literal, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.process.log_throttle import LogThrottle
from api.protocol.errors import APIError

logger = logging.getLogger("batchserve.connections")

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
LINGER_S = 1.0

_Phase = Literal["head", "body"]


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    request_read_timeout_s: float
    max_connections: int


def raw_response(error: APIError) -> bytes:
    """`error` as a whole HTTP/1.1 response that closes the connection."""
    body = json.dumps(error.body()).encode()
    head = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in error.headers.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


_TOO_MANY_CONNECTIONS = raw_response(
    APIError(
        503,
        "the server has too many open connections; retry shortly",
        code="too_many_connections",
        headers={"Retry-After": "1"},
    )
)
_HTTP2_REFUSED = raw_response(
    APIError(505, "HTTP/2 is not supported; send HTTP/1.1 requests", code="http_version_not_supported")
)
_MALFORMED = raw_response(
    APIError(400, "the request is not valid HTTP/1.1 (its request line, headers or chunked body)", code="invalid_http")
)


_CUT_OFF = "ASGI callable returned without completing response."


class _ClientFaultLogger(logging.LoggerAdapter[logging.Logger]):
    """uvicorn's protocol warns about each malformed or unsupported request: the client's fault, logged at INFO.
    Its errors (an exception in the app) keep their level, but for a response the app cut off on purpose."""

    def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.info(msg, *args, **kwargs)

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        if msg == _CUT_OFF:  # the event stream cut off a subscriber that stopped reading (api/live/stream_routes.py)
            self.info("closed an event stream whose subscriber stopped reading", **kwargs)
            return
        self.logger.error(msg, *args, **kwargs)

    @property
    def level(self) -> int:  # uvicorn reads `logger.level`, which an adapter does not have
        return self.logger.level


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above; `protocol_class` binds it to one server's limits."""

    limits: ClassVar[ConnectionLimits]
    refusals: ClassVar[LogThrottle]  # one "refusing connections" line a second, not one per connection

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = _ClientFaultLogger(self.logger)  # type: ignore[assignment]
        self._phase: _Phase | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._preface: bytes | None = b""  # first bytes held while they may be an HTTP/2 preface; None once not
        self._answered = False  # our last word is written: input is dropped until the client closes
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport  # never registered: it does not count, and shutdown does not wait for it
            suppressed = self.refusals.admit()
            if suppressed is not None:
                logger.warning(
                    "refusing connections: %d are open (--max-connections); %d more refused since the last report",
                    len(self.connections),
                    suppressed,
                )
            self._answer(_TOO_MANY_CONNECTIONS)
            return
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return
        if self._preface is not None:
            held = self._preface + data
            if held.startswith(HTTP2_PREFACE):
                logger.info("refusing an HTTP/2 connection from %s", self._peer())
                self._answer(_HTTP2_REFUSED)
                return
            if HTTP2_PREFACE.startswith(held):  # maybe the start of one: hold it back from h11
                self._preface = held
                self._unset_keepalive_if_required()
                self._set_phase("head")
                return
            self._preface = None
            data = held
        super().data_received(data)
        self._sync_phase(bytes_arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_phase(bytes_arrived=False)

    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request (uvicorn has logged `msg`)."""
        self._answer(_MALFORMED)

    def shutdown(self) -> None:
        if self._answered:
            self.transport.close()
        else:
            super().shutdown()

    def _sync_phase(self, bytes_arrived: bool) -> None:
        """Arm the deadline for what the client is sending now: a head, a body, or nothing."""
        if self._answered or self.transport.is_closing():
            self._set_phase(None)
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            started = bytes_arrived or bool(self.conn.trailing_data[0])  # else idle: the keep-alive timer's
            self._set_phase("head" if started else None)
        elif state is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase(None)

    def _set_phase(self, phase: _Phase | None) -> None:
        """Same phase: keep the running deadline, so that each trickled byte does not extend it."""
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            self._deadline = self.loop.call_later(self._timeout(phase), self._read_timed_out)

    def _timeout(self, phase: _Phase) -> float:
        return self.limits.header_timeout_s if phase == "head" else self.limits.request_read_timeout_s

    def _read_timed_out(self) -> None:
        phase = self._phase
        self._deadline, self._phase = None, None
        if phase is None or self.transport.is_closing():
            return
        part, timeout = f"request {phase}", self._timeout(phase)
        logger.info("closing a connection from %s: its %s was not complete within %g s", self._peer(), part, timeout)
        error = APIError(408, f"the {part} was not received within {timeout:g} s", code="request_timeout")
        self._answer(raw_response(error))

    def _answer(self, response: bytes) -> None:
        """Write `response` unless one is already under way, then end the connection once the client has it."""
        self._answered = True
        self._set_phase(None)
        self._unset_keepalive_if_required()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A handler still waiting for its body gets http.disconnect, and whatever it answers is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(response)
        self.transport.resume_reading()  # drain (and drop) what the client still sends
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "an unknown peer"


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class for one server: uvicorn builds protocols from a class and its own Config only."""
    attributes = {"limits": limits, "refusals": LogThrottle(1.0)}
    return cast(type[GuardedH11Protocol], type("GuardedH11Protocol", (GuardedH11Protocol,), attributes))
