"""Stored responses (`store: true`), for `GET /v1/responses/{id}` and `previous_response_id`: each entry holds the
response and the whole conversation up to it (earlier turns, its input, its output, as chat messages; never the
instructions, which OpenAI does not carry over), so a continuation needs only its one predecessor.

Bounded by count and by bytes (`--responses-store-max-count`, `--responses-store-max-bytes`): the oldest entries
go first. An entry larger than the whole byte bound is not kept. One store per app, used on its event loop only."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("batchserve.api")


@dataclass(frozen=True)
class StoreLimits:
    max_count: int  # 0: nothing is kept
    max_bytes: int  # of the entries as compact JSON


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    size: int  # bytes, as compact JSON


class ResponseStore:
    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep `response` (under its id) with its conversation, evicting the oldest entries to make room; False
        when it cannot fit even alone."""
        size = len(json.dumps(response, separators=(",", ":"))) + len(json.dumps(conversation, separators=(",", ":")))
        if self.limits.max_count == 0 or size > self.limits.max_bytes:
            logger.info("response %s (%d bytes) is not stored: the store's bound is smaller", response["id"], size)
            return False
        self.delete(response["id"])
        while self._entries and (
            len(self._entries) >= self.limits.max_count or self._bytes + size > self.limits.max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size
        self._entries[response["id"]] = StoredResponse(response, conversation, size)
        self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
