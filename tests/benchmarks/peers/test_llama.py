"""llama.cpp baseline: launch arguments, build and cache steps, and the decode probe's arithmetic (no build)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from benchmarks.loadgen.client import EosPolicy, RequestRecord
from benchmarks.peers import llama_cpp, llama_probe, targets
from benchmarks.peers.targets import ServerSettings, Target, Unavailable, baseline_targets, llama_server_argv


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def llama_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[llama_cpp.LlamaCppCache, Path]:
    """A built-looking cache (binary and f32 GGUF) and a default Q4_1 model, all empty files."""
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    q4 = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    q4.parent.mkdir()
    q4.write_bytes(b"")
    monkeypatch.setattr(targets, "default_model_path", lambda: q4)
    monkeypatch.setattr(targets, "_cpu_threads", lambda: 2)
    monkeypatch.setattr(targets.shutil, "which", lambda name: None)
    cache = llama_cpp.default_cache()
    for path in (cache.server, cache.f32_gguf(q4)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    return cache, q4


def test_llama_server_argv_sizes_slots_like_batchserve_seats() -> None:
    argv = llama_server_argv(Path("/bin/llama-server"), Path("/m/model.gguf"), seats=16, max_model_len=2048, threads=2)
    assert argv[:3] == ("/bin/llama-server", "-m", "/m/model.gguf")
    assert (_flag(argv, "--host"), _flag(argv, "--port")) == ("{host}", "{port}")
    assert (_flag(argv, "-t"), _flag(argv, "-tb")) == ("2", "2")
    assert _flag(argv, "--parallel") == "16"
    assert _flag(argv, "-c") == str(16 * 2048)  # split per slot: 2048 each
    assert {"--cont-batching", "--no-kv-unified", "--metrics"} <= set(argv)


def test_f32_and_q4_1_baselines_run_the_cached_server_on_their_gguf(
    llama_cache: tuple[llama_cpp.LlamaCppCache, Path],
) -> None:
    cache, q4 = llama_cache
    f32, q4_1 = baseline_targets(("llama-f32", "llama-q4_1"), ServerSettings(seats=16))
    assert isinstance(f32, Target) and isinstance(q4_1, Target)
    assert [f32.name, q4_1.name] == ["llama-f32", "llama-q4_1"]
    assert _flag(f32.argv, "-m") == str(cache.f32_gguf(q4))
    assert cache.f32_gguf(q4).name == "SmolLM2-135M-Instruct-f32.gguf"
    assert _flag(q4_1.argv, "-m") == str(q4)
    for target in (f32, q4_1):
        assert target.argv[0] == str(cache.server)
        assert _flag(target.argv, "--parallel") == "16"
        assert _flag(target.argv, "-c") == str(16 * 2048)  # batchserve's default max_model_len per seat
        assert (_flag(target.argv, "-t"), _flag(target.argv, "-tb")) == ("2", "2")
        assert target.eos_policy is EosPolicy.IGNORE_EOS


def test_plain_llama_server_falls_back_to_the_cached_build(llama_cache: tuple[llama_cpp.LlamaCppCache, Path]) -> None:
    cache, q4 = llama_cache
    (found,) = baseline_targets(("llama-server",), ServerSettings(seats=4, model=str(q4)))
    assert isinstance(found, Target)
    assert found.argv[0] == str(cache.server)
    assert _flag(found.argv, "-m") == str(q4)
    assert _flag(found.argv, "-c") == str(4 * 2048)


def test_unbuilt_or_non_default_model_baselines_say_why(llama_cache: tuple[llama_cpp.LlamaCppCache, Path]) -> None:
    cache, q4 = llama_cache
    cache.f32_gguf(q4).unlink()
    (f32,) = baseline_targets(("llama-f32",), ServerSettings())
    assert isinstance(f32, Unavailable) and "benchmarks llama-build build" in f32.reason
    (other,) = baseline_targets(("llama-q4_1",), ServerSettings(model="/elsewhere.gguf"))
    assert isinstance(other, Unavailable) and "default model" in other.reason
    cache.server.unlink()
    (plain,) = baseline_targets(("llama-server",), ServerSettings(model=str(q4)))
    assert isinstance(plain, Unavailable) and "not on PATH" in plain.reason


def test_build_is_cpu_only_native_static_and_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp.platform, "machine", lambda: "x86_64")
    argv = llama_cpp.configure_argv(Path("/src"), Path("/build"))
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in argv  # AMX faults on the dev VM
    for option in (
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DGGML_CUDA=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
    ):
        assert option in argv
    monkeypatch.setattr(llama_cpp.platform, "machine", lambda: "aarch64")
    assert not any("amx" in arg for arg in llama_cpp.configure_argv(Path("/src"), Path("/build")))
    assert llama_cpp.build_argv(Path("/build"), 2) == [
        "cmake", "--build", "/build", "--target", "llama-server", "-j", "2"
    ]  # fmt: skip


def test_cached_binary_and_gguf_are_reused_without_running_anything(
    llama_cache: tuple[llama_cpp.LlamaCppCache, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, q4 = llama_cache

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing should run when the cache is filled")

    monkeypatch.setattr(subprocess, "run", refuse)
    assert llama_cpp.build_server(cache) == cache.server
    assert llama_cpp.convert_f32(cache, q4) == cache.f32_gguf(q4)


def test_only_the_vendored_llama_cpp_tree_is_extracted(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name in ("pkg/vendor/llama.cpp/CMakeLists.txt", "pkg/vendor/llama.cpp/gguf-py/x.py", "pkg/setup.py"):
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    dest = llama_cpp.extract_source(sdist, tmp_path / "src")
    assert (dest / "CMakeLists.txt").read_text() == "pkg/vendor/llama.cpp/CMakeLists.txt"
    assert (dest / "gguf-py" / "x.py").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama_cpp_python-9.9.9.tar.gz", "src"]


def _record(index: int, chunk_times: list[float], output_tokens: int | None = None) -> RequestRecord:
    return RequestRecord(
        index=index,
        kind="probe",
        max_tokens=len(chunk_times),
        prompt_tokens_est=8,
        scheduled_time=0.0,
        send_time=0.0,
        first_token_time=chunk_times[0],
        chunk_times=tuple(chunk_times),
        end_time=chunk_times[-1],
        output_tokens=len(chunk_times) if output_tokens is None else output_tokens,
        prompt_tokens=8,
        usage_reported=True,
        server_timings=None,
        finish_reason="length",
        text="x" * len(chunk_times),
        error=None,
    )


def test_batch1_time_per_token_leaves_out_the_first_token() -> None:
    record = _record(0, [5.0, 5.1, 5.2, 5.3, 5.4])  # prefill took 5 s, then 0.1 s per token
    assert llama_probe.decode_ms_per_token(record) == pytest.approx(100.0)


def test_steady_decode_counts_only_while_every_request_decodes() -> None:
    early = _record(0, [1.0 + 0.25 * i for i in range(40)])  # 1.0 .. 10.75
    late = _record(1, [2.0 + 0.25 * i for i in range(40)])  # 2.0 .. 11.75
    steady = llama_probe.steady_decode([early, late])
    assert steady.window_s == 8.75  # from the late one's first token to the early one's last
    assert steady.tokens == 35 + 35  # chunks in (2.0, 10.75], one token each
    merged = _record(1, [2.0 + 0.5 * i for i in range(20)], output_tokens=40)  # two tokens per chunk
    assert llama_probe.steady_decode([early, merged]).tokens == 35 + 2 * 17


def test_steady_decode_needs_an_overlap() -> None:
    with pytest.raises(ValueError, match="raise --tokens"):
        llama_probe.steady_decode([_record(0, [1.0, 1.1]), _record(1, [2.0, 2.1])])
