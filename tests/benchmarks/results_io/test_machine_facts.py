"""Every result file names its machine: the facts come from /proc/cpuinfo's first processor."""

from pathlib import Path

from benchmarks.results_io.machine import machine_facts

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
cache size\t: 1024 KB
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16 sha_ni

processor\t: 1
model name\t: AMD EPYC 9B14
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16 sha_ni
"""


def test_reads_model_cache_and_only_the_kernel_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    facts = machine_facts(cpuinfo)
    assert facts["cpu"] == "AMD EPYC 9B14"
    assert facts["cache"] == "1024 KB"
    assert facts["kernel_flags"] == ["avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"]
    assert facts["cores"] >= 1


def test_missing_cpuinfo_gives_no_flags_rather_than_failing(tmp_path: Path) -> None:
    facts = machine_facts(tmp_path / "absent")
    assert facts["kernel_flags"] == []
    assert facts["cache"] is None
