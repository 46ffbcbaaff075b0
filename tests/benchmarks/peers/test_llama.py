"""llama.cpp baseline: launch arguments, build and cache steps, and the decode probe's arithmetic (no build)."""

from __future__ import annotations

import dataclasses
import io
import os
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
    for path in (cache.server, cache.quantize_tool, cache.f32_gguf(q4)):
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
    (other,) = baseline_targets(("llama-q4_0",), ServerSettings(model="/elsewhere.gguf"))
    assert isinstance(other, Unavailable)
    assert "llama-build build --model /elsewhere.gguf --quantize Q4_0" in other.reason
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
        "cmake", "--build", "/build", "--target", "llama-server", "llama-quantize", "-j", "2"
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
    cache.gguf(q4, "Q4_K_M").write_bytes(b"")
    assert llama_cpp.quantize(cache, q4, "Q4_K_M") == cache.gguf(q4, "Q4_K_M")


def test_every_format_is_one_file_both_servers_load(
    llama_cache: tuple[llama_cpp.LlamaCppCache, Path], tmp_path: Path
) -> None:
    """The shipped Q4_1 is served as it is; other formats, and any format of another model, come from the cache."""
    cache, q4 = llama_cache
    assert targets.format_gguf("Q4_1", None) == q4
    assert targets.format_gguf("Q4_0", None) == cache.root / "SmolLM2-135M-Instruct-Q4_0.gguf"
    folder = tmp_path / "llama-1b"
    folder.mkdir()
    assert targets.format_gguf("Q4_K_M", str(folder)) == cache.root / "llama-1b-Q4_K_M.gguf"
    dotted = tmp_path / "llama-3.2-1b-random"
    dotted.mkdir()
    assert llama_cpp.model_stem(dotted) == "llama-3.2-1b-random"  # a folder's dots are its name's
    assert llama_cpp.model_stem(Path("Llama-3.2-1B.Q4_K_M.gguf")) == "Llama-3.2-1B"
    assert llama_cpp.model_stem(Path("Llama-3.2-1B.gguf")) == "Llama-3.2-1B"
    for kind in ("Q4_0", "Q4_K_M"):
        cache.gguf(q4, kind).write_bytes(b"")
    found = baseline_targets(("llama-q4_0", "llama-q4_k_m"), ServerSettings(seats=2))
    assert [_flag(t.argv, "-m") for t in found if isinstance(t, Target)] == [
        str(cache.gguf(q4, "Q4_0")),
        str(cache.gguf(q4, "Q4_K_M")),
    ]


def test_quantize_runs_llama_quantize_on_the_f32_file(
    llama_cache: tuple[llama_cpp.LlamaCppCache, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, q4 = llama_cache
    ran: list[list[str]] = []

    def fake_run(argv: list[str], check: bool) -> None:
        ran.append(argv)
        Path(argv[2]).write_bytes(b"q")  # llama-quantize's output argument

    monkeypatch.setattr(subprocess, "run", fake_run)
    out = llama_cpp.quantize(cache, q4, "Q4_0", threads=2)
    assert ran == [
        [str(cache.quantize_tool), str(cache.f32_gguf(q4)), str(out.with_name(f".{out.name}.partial")), "Q4_0", "2"]
    ]
    assert out.read_bytes() == b"q"
    with pytest.raises(ValueError, match="Q4_K_S"):
        llama_cpp.quantize(cache, q4, "Q4_K_S")


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


def test_server_time_per_token_reads_either_servers_timings() -> None:
    record = _record(0, [5.0, 5.1, 5.2, 5.3, 5.4])
    assert llama_probe.server_ms_per_token(record) is None
    llama = dataclasses.replace(record, server_timings={"predicted_per_token_ms": 9.5})
    assert llama_probe.server_ms_per_token(llama) == 9.5
    ours = dataclasses.replace(record, server_timings={"decode_time_ms": 360.0, "time_to_first_token_ms": 40.0})
    assert llama_probe.server_ms_per_token(ours) == pytest.approx(90.0)  # 4 tokens after the first


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


def test_summary_takes_the_long_prompts_median_ttft_and_the_rounds_median() -> None:
    single = [_record(0, [0.5 + 0.01 * i for i in range(9)])]  # 10 ms a token after the first
    batch = [_record(1, [1.0 + 0.1 * i for i in range(9)]), _record(2, [1.0 + 0.1 * i for i in range(9)])]
    long_prompts = [_record(3, [t, t + 0.01]) for t in (0.2, 0.4, 0.3)]  # sent at 0: TTFT 200, 400, 300 ms
    records = llama_probe.ProbeRecords(single, batch, long_prompts)
    result = llama_probe.summarise("batchserve-q4_0", "cmd", records, start_s=12.0, memory=(300.0, 200.0))
    assert result.long_prompt_ttft_ms == pytest.approx(300.0)
    assert result.long_prompt_tokens == 8  # the server's own count, from usage
    assert result.batch1_ms_per_token == pytest.approx(10.0)
    assert (result.start_s, result.peak_rss_mib, result.rss_mib) == (12.0, 300.0, 200.0)
    slower = dataclasses.replace(result, batch1_ms_per_token=30.0, long_prompt_ttft_ms=None, start_s=5.0)
    faster = dataclasses.replace(result, batch1_ms_per_token=20.0, long_prompt_ttft_ms=100.0, start_s=4.0)
    combined = llama_probe.combine_rounds([result, slower, faster])
    assert combined.batch1_ms_per_token == pytest.approx(20.0)
    assert combined.long_prompt_ttft_ms == pytest.approx(200.0)  # the median of the rounds that measured it
    assert combined.start_s == 12.0  # the first start, the one that converts and measures formats


def test_pairs_compare_each_format_on_the_same_file() -> None:
    base = llama_probe.summarise(
        "x", "cmd", llama_probe.ProbeRecords([_record(0, [0.5, 0.51, 0.52])], [_record(1, [1.0, 1.1, 1.2])], [])
    )
    ours = dataclasses.replace(base, server="batchserve-q4_0", batch1_ms_per_token=8.0, batch_tok_s=300.0)
    theirs = dataclasses.replace(base, server="llama-q4_0", batch1_ms_per_token=10.0, batch_tok_s=200.0)
    lonely = dataclasses.replace(base, server="llama-q4_1")
    table = llama_probe.format_pairs([ours, theirs, lonely])
    assert "| q4_0 | 0.80x | 1.50x | - |" in table
    assert "q4_1" not in table  # no batchserve row on that file
    assert "long prompt TTFT ms" in llama_probe.format_table([ours, theirs])


def test_batchserve_format_servers_load_the_llama_file(llama_cache: tuple[llama_cpp.LlamaCppCache, Path]) -> None:
    cache, q4 = llama_cache
    cache.gguf(q4, "Q4_0").write_bytes(b"")
    found = llama_probe.probe_targets(["batchserve-q4_0", "batchserve-q4_k_m", "batchserve-q4_1"], batch=4)
    q4_0, q4_k_m, q4_1 = found
    assert isinstance(q4_0, Target) and _flag(q4_0.argv, "--model") == str(cache.gguf(q4, "Q4_0"))
    assert isinstance(q4_k_m, Unavailable) and "llama-build" in q4_k_m.reason
    assert isinstance(q4_1, Target) and _flag(q4_1.argv, "--model") == str(q4)  # the shipped file itself


def test_memory_reads_this_process() -> None:
    peak, resident = llama_probe.memory_mib(os.getpid())
    assert resident is not None and resident > 10  # an interpreter with torch imported holds more than 10 MiB
    assert peak is not None and peak >= resident
    assert llama_probe.memory_mib(2**22 + 7) == (None, None)  # no such process


@pytest.mark.parametrize(
    ("server", "scope"),
    [
        ("batchserve-int4-gemm", "all"),
        ("batchserve-int4-gemm-except-qkv", "except-qkv"),
        ("batchserve-int4-gemm-off", "off"),
    ],
)
def test_the_int4_gemm_servers_are_the_default_model_with_the_flag(server: str, scope: str) -> None:
    plain, gemm = llama_probe.probe_targets(["batchserve", server], batch=4)
    assert isinstance(plain, Target) and isinstance(gemm, Target)
    assert "--int4-gemm" not in plain.argv
    flag = gemm.argv.index("--int4-gemm")
    assert gemm.argv[flag + 1] == scope
    assert gemm.argv[:flag] + gemm.argv[flag + 2 :] == plain.argv


@pytest.mark.parametrize(
    ("cap", "isa", "on", "off"),
    [
        ("", "native", ["-DGGML_NATIVE=ON"], []),
        ("avx2", "avx2", ["-DGGML_AVX2=ON"], ["-DGGML_AVX512=ON"]),
        ("avx512_vnni", "avx512_vnni", ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"], ["-DGGML_AVX512_BF16=ON"]),
        ("avx512_bf16", "native", ["-DGGML_NATIVE=ON"], []),  # no capped llama.cpp build for it: the CPU's own
    ],
)
def test_a_cap_builds_and_runs_llama_cpp_for_the_same_class(
    monkeypatch: pytest.MonkeyPatch, cap: str, isa: str, on: list[str], off: list[str]
) -> None:
    """BATCHSERVE_CPU_ISA picks llama.cpp's binary too, so a capped comparison runs both on one class's paths: AVX2
    only, or the Xeon class with AVX-512 VNNI and no BF16."""
    monkeypatch.setenv("BATCHSERVE_CPU_ISA", cap)
    cache = llama_cpp.default_cache()
    assert cache.isa == isa
    assert cache.server.name == ("llama-server" if isa == "native" else f"llama-server-{isa}")
    argv = llama_cpp.configure_argv(Path("/src"), Path("/build"), cache.isa)
    assert all(option in argv for option in on) and not any(option in argv for option in off)
    if isa != "native":
        assert "-DGGML_NATIVE=OFF" in argv
