"""The response store: bounded by count and by bytes, oldest first, and an entry past the byte bound never kept."""

from __future__ import annotations

import json
from typing import Any

from api.translation.response_store import ResponseStore, StoreLimits


def _response(i: int, text: str = "") -> dict[str, Any]:
    return {"id": f"resp_{i}", "object": "response", "output": [text]}


def _size(i: int, text: str = "") -> int:
    conversation = [{"role": "user", "content": text}]
    return len(json.dumps(_response(i, text), separators=(",", ":"))) + len(
        json.dumps(conversation, separators=(",", ":"))
    )


def _put(store: ResponseStore, i: int, text: str = "") -> bool:
    return store.put(_response(i, text), [{"role": "user", "content": text}])


def test_the_count_bound_evicts_the_oldest_first() -> None:
    store = ResponseStore(StoreLimits(max_count=3, max_bytes=1 << 20))
    for i in range(5):
        assert _put(store, i)
    assert len(store) == 3
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.bytes == sum(_size(i) for i in (2, 3, 4))
    stored = store.get("resp_3")
    assert stored is not None and stored.conversation == [{"role": "user", "content": ""}]


def test_the_byte_bound_evicts_as_many_of_the_oldest_as_it_takes() -> None:
    one = _size(0, "x" * 100)
    store = ResponseStore(StoreLimits(max_count=100, max_bytes=3 * one))
    for i in range(3):
        _put(store, i, "x" * 100)
    assert len(store) == 3 and store.bytes == 3 * one
    assert _put(store, 3, "x" * 250)  # needs the room of two and a half entries: the three oldest go
    assert [store.get(f"resp_{i}") is not None for i in range(4)] == [False, False, False, True]
    assert store.bytes == _size(3, "x" * 250) <= store.limits.max_bytes


def test_an_entry_larger_than_the_whole_bound_is_not_kept_and_evicts_nothing() -> None:
    store = ResponseStore(StoreLimits(max_count=10, max_bytes=200))
    assert _put(store, 0)
    assert not _put(store, 1, "x" * 500)
    assert store.get("resp_1") is None and store.get("resp_0") is not None and len(store) == 1


def test_a_count_of_zero_keeps_nothing() -> None:
    store = ResponseStore(StoreLimits(max_count=0, max_bytes=1 << 20))
    assert not _put(store, 0)
    assert len(store) == 0 and store.bytes == 0


def test_delete_frees_its_bytes_and_a_second_delete_finds_nothing() -> None:
    store = ResponseStore(StoreLimits(max_count=10, max_bytes=1 << 20))
    _put(store, 0)
    _put(store, 1)
    assert store.delete("resp_0") and not store.delete("resp_0")
    assert store.bytes == _size(1) and len(store) == 1


def test_storing_an_id_again_replaces_it() -> None:
    store = ResponseStore(StoreLimits(max_count=2, max_bytes=1 << 20))
    _put(store, 0)
    _put(store, 1)
    _put(store, 0, "again")  # the newest now: resp_1 is the oldest
    _put(store, 2)
    assert store.get("resp_1") is None
    stored = store.get("resp_0")
    assert stored is not None and stored.response["output"] == ["again"]
    assert store.bytes == _size(0, "again") + _size(2)
