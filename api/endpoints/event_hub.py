"""Fan-out of the schedulers' event feeds to the subscribers of `GET /v1/events` (format: docs/events.md).

The loop thread hands each step's events over in one `call_soon_threadsafe` and returns; everything else runs on
the event loop: each event is encoded once (twice at most: with and without text) and appended to every
subscriber's bounded queue. A subscriber that falls behind loses its queue to one `lagged` summary and starts again
from a fresh `hello`; one that falls behind again before reading that summary is disconnected. So a subscriber that
stops reading holds at most one queue of frames, and the engine never waits for anyone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from scheduler.core import Scheduler
from scheduler.events import Lane, PointKind, RequestPoint, SchedulerEvent, Snapshot, StepEvent

logger = logging.getLogger("batchserve.api")

QUEUE_FRAMES = 1024  # per subscriber: about 1 MB of step events at 64 seats
MAX_SUBSCRIBERS = 64
PROMPT_PREVIEW_TOKENS = 64
PROMPT_PREVIEW_CHARS = 200
OUTPUT_TEXT_CHARS = 4000


@dataclass(frozen=True)
class ModeSource:
    """One mode's scheduler as the hub sees it: its feed, how to ask it for a snapshot, and what `hello` says."""

    mode: str
    scheduler: Scheduler
    request_snapshot: Callable[[], None]  # wakes the loop thread, which records a Snapshot at its next boundary
    tokenizer: PreTrainedTokenizerBase
    hello: Mapping[str, Any]  # model, seats and the policy's settings


def _frame(kind: str, payload: Mapping[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _lanes(lanes: Sequence[Lane]) -> list[dict[str, Any]]:
    return [{"seat": lane.seat, "request_id": lane.request_id, "phase": lane.phase.value} for lane in lanes]


class Subscriber:
    """One reader of the stream: a bounded queue of encoded frames, filled by the hub, emptied by `frames()`."""

    def __init__(self, hub: EventHub, modes: tuple[str, ...], include_text: bool, size: int) -> None:
        self.hub = hub
        self.modes = modes
        self.include_text = include_text
        self.kicked = asyncio.Event()  # set when it is disconnected for falling behind
        self.awaiting_hello: set[str] = set(modes)  # events of these modes wait for their hello first
        self._size = size
        self._queue: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self._lagged: bytes | None = None  # the unread lagged summary, if any
        self.closed = False

    def push(self, mode: str, frame: bytes) -> None:
        if self.closed or mode in self.awaiting_hello:
            return
        self._append(mode, frame)

    def push_hello(self, mode: str, frame: bytes) -> None:
        if self.closed or mode not in self.awaiting_hello:
            return
        self.awaiting_hello.discard(mode)
        self._append(mode, frame)

    def _append(self, mode: str, frame: bytes) -> None:
        if len(self._queue) >= self._size:
            if self._lagged is not None:  # behind again before reading the summary: let it go
                self.hub.kick(self)
                return
            dropped = len(self._queue) + 1
            self._queue.clear()
            self._lagged = _frame("lagged", {"mode": mode, "t": self.hub.elapsed(), "dropped": dropped})
            self._queue.append(self._lagged)
            self.awaiting_hello = set(self.modes)
            self.hub.lagged += 1
            self.hub.request_snapshots(self.modes)
        else:
            self._queue.append(frame)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def frames(self) -> AsyncGenerator[bytes, None]:
        try:
            while True:
                while self._queue:
                    frame = self._queue.popleft()
                    if frame is self._lagged:
                        self._lagged = None
                    yield frame
                if self.closed:
                    return
                self._ready.clear()
                await self._ready.wait()
        finally:
            self.hub.unsubscribe(self)


@dataclass
class _Encoded:
    """One event's frames, made on first need: with text (queued, finished) and without."""

    plain: bytes | None = None
    text: bytes | None = None


@dataclass
class EventHub:
    """Every mode's feed in, every subscriber out; lives on the server's event loop."""

    loop: asyncio.AbstractEventLoop
    origin: float  # the scheduler clock's reading at server start: events' `t` counts from it
    clock: Callable[[], float]
    queue_size: int = QUEUE_FRAMES
    max_subscribers: int = MAX_SUBSCRIBERS
    sources: dict[str, ModeSource] = field(default_factory=dict)
    subscribers: list[Subscriber] = field(default_factory=list)
    lagged: int = 0  # summaries sent, for the tests and the curious
    disconnected: int = 0

    def elapsed(self) -> float:
        return round(self.clock() - self.origin, 6)

    def add_source(self, source: ModeSource) -> None:
        """Any thread (the loader's). The listener runs on the loop thread: it only schedules the dispatch."""
        self.sources[source.mode] = source
        mode, loop = source.mode, self.loop

        def listener(batch: list[SchedulerEvent]) -> None:
            try:
                loop.call_soon_threadsafe(self._dispatch, mode, batch)
            except RuntimeError:  # the event loop closed (shutdown): nobody is listening any more
                source.scheduler.events.enabled = False

        source.scheduler.events.attach(listener)

    def subscribe(self, modes: tuple[str, ...], include_text: bool) -> Subscriber | None:
        """A new subscriber, or None when the server has as many as it takes."""
        if len(self.subscribers) >= self.max_subscribers:
            return None
        subscriber = Subscriber(self, modes, include_text, self.queue_size)
        self.subscribers.append(subscriber)
        for mode in modes:
            self.sources[mode].scheduler.events.enabled = True
        self.request_snapshots(modes)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        subscriber.close()
        if subscriber in self.subscribers:
            self.subscribers.remove(subscriber)
        for mode in subscriber.modes:
            if not any(mode in s.modes for s in self.subscribers):
                self.sources[mode].scheduler.events.enabled = False  # back to a recorder that records nothing

    def kick(self, subscriber: Subscriber) -> None:
        logger.info("an event stream subscriber fell behind twice; disconnecting it")
        self.disconnected += 1
        subscriber.close()
        subscriber.kicked.set()
        self.unsubscribe(subscriber)

    def request_snapshots(self, modes: Sequence[str]) -> None:
        for mode in modes:
            self.sources[mode].request_snapshot()

    def _dispatch(self, mode: str, batch: list[SchedulerEvent]) -> None:
        readers = [s for s in self.subscribers if mode in s.modes]
        if not readers:
            return
        source = self.sources[mode]
        for event in batch:
            if isinstance(event, Snapshot):
                hello = _frame("hello", self._hello(source, event))
                for reader in readers:
                    reader.push_hello(mode, hello)
                continue
            encoded = _Encoded()
            for reader in readers:
                if reader.closed:
                    continue
                reader.push(mode, self._encode(source, event, encoded, reader.include_text))

    def _encode(self, source: ModeSource, event: SchedulerEvent, encoded: _Encoded, with_text: bool) -> bytes:
        if isinstance(event, RequestPoint) and event.token_ids and with_text:
            if encoded.text is None:
                encoded.text = _frame("request", self._request(source, event, text=True))
            return encoded.text
        if encoded.plain is None:
            if isinstance(event, StepEvent):
                encoded.plain = _frame("step", self._step(source, event))
            else:
                assert isinstance(event, RequestPoint)
                encoded.plain = _frame("request", self._request(source, event, text=False))
        return encoded.plain

    def _t(self, time: float) -> float:
        return round(time - self.origin, 6)

    def _hello(self, source: ModeSource, snapshot: Snapshot) -> dict[str, Any]:
        return {
            "mode": source.mode,
            "t": self._t(snapshot.time),
            **source.hello,
            "lanes": _lanes(snapshot.lanes),
            "waiting": snapshot.waiting,
            "running": snapshot.running,
            "held": snapshot.held,
        }

    def _step(self, source: ModeSource, event: StepEvent) -> dict[str, Any]:
        return {
            "mode": source.mode,
            "t": self._t(event.time),
            "step": event.step,
            "duration_ms": round(event.duration * 1000.0, 3),
            "lanes": _lanes(event.lanes),
            "waiting": event.waiting,
            "running": event.running,
            "held": event.held,
            "tokens": event.tokens,
            "prompt_tokens": event.prompt_tokens,
            "generated": event.generated,
            "drafted": event.drafted,
            "accepted": event.accepted,
        }

    def _request(self, source: ModeSource, event: RequestPoint, text: bool) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "mode": source.mode,
            "t": self._t(event.time),
            "request_id": event.request_id,
            "event": event.kind.value,
            "seat": event.seat,
        }
        for key, value in event.details.items():
            payload[key] = round(value, 3) if isinstance(value, float) else value
        if text:
            payload["text"] = self._text(source.tokenizer, event)
        return payload

    @staticmethod
    def _text(tokenizer: PreTrainedTokenizerBase, event: RequestPoint) -> str:
        if event.kind is PointKind.QUEUED:
            ids = list(event.token_ids[:PROMPT_PREVIEW_TOKENS])
            return str(tokenizer.decode(ids, skip_special_tokens=True))[:PROMPT_PREVIEW_CHARS]
        return str(tokenizer.decode(list(event.token_ids), skip_special_tokens=True))[:OUTPUT_TEXT_CHARS]
