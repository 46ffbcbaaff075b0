"""Every result file names its machine: the facts come from /proc/cpuinfo's first processor, the one JSON writer
adds them, and new result folders are named by date and machine."""

import json
from datetime import date
from pathlib import Path

import pytest

from benchmarks.results_io.machine import code_facts, dated_result_dir, machine_facts, machine_label
from benchmarks.results_io.report import write_json

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


def test_result_folders_are_named_by_experiment_date_and_machine_family(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    assert machine_label(machine_facts(cpuinfo)) == "epyc"
    assert machine_label({"cpu": None, "arch": "aarch64"}) == "aarch64"
    folder = dated_result_dir("quality", tmp_path)
    assert folder.parent == tmp_path / "quality"
    assert folder.name == f"{date.today().isoformat()}-{machine_label()}"


def test_write_json_records_the_machine_in_results_but_not_in_raw_records(tmp_path: Path) -> None:
    result = json.loads(write_json(tmp_path / "deep" / "result.json", {"value": 1}).read_text())
    assert result == {"machine": machine_facts(), "value": 1}
    own = json.loads(write_json(tmp_path / "own.json", {"machine": {"cpu": "x"}}).read_text())
    assert own == {"machine": {"cpu": "x"}}
    raw = json.loads(write_json(tmp_path / "raw.json", {"records": []}, with_machine=False).read_text())
    assert raw == {"records": []}
    assert json.loads(write_json(tmp_path / "list.json", [1, 2]).read_text()) == [1, 2]
    with pytest.raises(ValueError):
        write_json(tmp_path / "nan.json", {"x": float("nan")})


def test_records_the_commit_the_cpu_cap_threads_and_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSERVE_CPU_ISA", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    facts = machine_facts(tmp_path / "absent")
    assert facts["cpu_cap"] == {"BATCHSERVE_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert facts["torch"] is not None and facts["torch"][0].isdigit()
    assert facts["threads"] is None or facts["threads"] >= 1
    if facts["commit"] is not None:  # a git checkout (CI's fresh clone is one)
        assert len(facts["commit"]) == 40 and isinstance(facts["dirty"], bool)


def test_outside_a_checkout_the_commit_is_unknown_not_an_error(tmp_path: Path) -> None:
    assert code_facts(tmp_path) == {"commit": None, "dirty": None}
