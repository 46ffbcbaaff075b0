"""Incremental Server-Sent Events parser: bytes from the network in, complete events out.

Network chunks do not respect frame boundaries, so the parser buffers partial lines and partial events.
Lines are split on bytes before decoding, which keeps a UTF-8 character that straddles two chunks intact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DONE = "[DONE]"


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None


@dataclass
class SSEParser:
    """Feed raw bytes with `feed`; call `close` at end of stream to flush what is left."""

    _buffer: bytes = b""
    _data_lines: list[str] = field(default_factory=list)
    _event: str = ""
    _id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buffer += chunk
        events: list[SSEEvent] = []
        while True:
            line, rest = _split_line(self._buffer)
            if line is None:
                break
            self._buffer = rest
            event = self._handle_line(line.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream. The spec drops an unterminated event; we keep it, since some servers omit the last
        blank line and losing the usage chunk would skew token counts."""
        events: list[SSEEvent] = []
        if self._buffer:
            trailing = self._buffer.rstrip(b"\r")
            self._buffer = b""
            event = self._handle_line(trailing.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        event = self._dispatch()
        if event is not None:
            events.append(event)
        return events

    def _handle_line(self, line: str) -> SSEEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):  # comment, e.g. keep-alive pings
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_lines.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        # "retry" and unknown fields are ignored, as the spec says.
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data_lines:
            self._event = ""
            return None
        event = SSEEvent(data="\n".join(self._data_lines), event=self._event or "message", id=self._id)
        self._data_lines = []
        self._event = ""
        return event


def _split_line(buffer: bytes) -> tuple[bytes | None, bytes]:
    """Take one line off the front of `buffer`, ended by CRLF, LF or CR.

    A CR at the very end is held back: the LF of a CRLF may still be in flight.
    """
    lf = buffer.find(b"\n")
    cr = buffer.find(b"\r")
    if cr == -1 and lf == -1:
        return None, buffer
    if cr == -1 or (lf != -1 and lf < cr):
        return buffer[:lf], buffer[lf + 1 :]
    if cr == len(buffer) - 1:
        return None, buffer
    end = cr + 2 if buffer[cr + 1 : cr + 2] == b"\n" else cr + 1
    return buffer[:cr], buffer[end:]
