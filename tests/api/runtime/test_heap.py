"""A server that owns its process freezes its heap after loading, so garbage collections skip the model."""

from __future__ import annotations

import gc
import logging
import re
import subprocess
import sys
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from api.config import ServerConfig
from api.endpoints.state import ServerState
from api.runtime.heap import frozen_after_loading
from tests.server_harness import compare_server, running_server


@pytest.fixture
def restore_heap() -> Iterator[None]:
    """What a test froze goes back to the collector: this process is pytest's, not a server's."""
    assert gc.get_freeze_count() == 0, "something froze the test process's heap before this test"
    yield
    gc.unfreeze()


class Node:
    other: Node


def _tracked(objects: Sequence[object]) -> list[bool]:
    ids = {id(o) for o in gc.get_objects()}  # the generations the collector walks; frozen objects are not there
    return [id(o) in ids for o in objects]


def test_loading_runs_without_collections_and_what_it_built_is_frozen(
    restore_heap: None, caplog: pytest.LogCaptureFixture
) -> None:
    assert gc.isenabled()
    with caplog.at_level(logging.INFO, logger="batchserve.server"), frozen_after_loading():
        assert not gc.isenabled()
        built = [Node() for _ in range(3)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(built)
    assert _tracked(built) == [False, False, False]
    # the process says so in its log (a Ray replica's driver cannot see its heap)
    said = re.search(r"heap frozen after loading: ([\d,]+) objects", caplog.text)
    assert said is not None and int(said[1].replace(",", "")) >= len(built)


def test_loadings_own_garbage_is_collected_before_the_freeze(restore_heap: None) -> None:
    with frozen_after_loading():
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle, which only the collector reclaims
        gone = weakref.ref(a)
        del a, b
    assert gone() is None


def test_a_failed_load_freezes_nothing_and_turns_the_collector_back_on() -> None:
    with pytest.raises(OSError, match="no weights"), frozen_after_loading():
        built = [Node()]
        raise OSError("no weights")
    assert gc.isenabled() and gc.get_freeze_count() == 0 and _tracked(built) == [True]


def test_disabled_it_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="batchserve.server"), frozen_after_loading(enabled=False):
        assert gc.isenabled()
        built = [Node()]
    assert gc.get_freeze_count() == 0 and _tracked(built) == [True]
    assert "heap frozen" not in caplog.text


@pytest.mark.parametrize("freeze_heap", [True, False])
def test_a_server_freezes_its_loaded_runtime_only_when_it_owns_the_process(
    freeze_heap: bool, restore_heap: None
) -> None:
    with running_server(ServerConfig(port=0), freeze_heap=freeze_heap) as server:
        runtime = server.runtime
        assert _tracked([runtime, runtime.engine]) == [not freeze_heap] * 2
        # and it serves as before
        answer = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3


def test_compare_freezes_both_modes_runtimes_when_it_owns_the_process(restore_heap: None) -> None:
    with compare_server(freeze_heap=True) as server:
        runtimes = [mode.runtime for mode in ServerState.of(server.app).modes.values()]
        assert len(runtimes) == 2 and _tracked(runtimes) == [False, False]
        answer = httpx.post(f"{server.base_url}/continuous/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200


_TRIM_SCRIPT = """
import sys
from api.runtime.heap import trim_heap

def resident_kib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4

held = [bytearray(4000) for _ in range(50_000)]  # about 200 MB from malloc's heap, below its mmap threshold
keep = bytearray(4000)  # allocated last: the heap's top stays in use, so free() alone cannot shrink it
del held
before = resident_kib()
trimmed = trim_heap()
print(trimmed, before, resident_kib())
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_trimming_returns_the_freed_heap_to_the_os() -> None:
    """The loader's freed memory (candidate weight copies) stays resident until malloc_trim hands it back."""
    out = subprocess.run([sys.executable, "-c", _TRIM_SCRIPT], capture_output=True, text=True, check=True).stdout
    trimmed, before, after = out.split()
    if trimmed == "False":
        pytest.skip("this C library has no malloc_trim")
    assert int(before) - int(after) > 100_000, out  # most of the ~200 MB freed goes back
