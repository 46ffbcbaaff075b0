"""The bandwidth probe reports what it read: sizes in order, positive rates, and a machine in its JSON."""

import json
from pathlib import Path

import pytest

from benchmarks.micro import membw


def test_probe_writes_one_row_per_size_with_its_machine(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    assert membw.main(["--sizes-mb", "1,4", "--repeats", "2", "--threads", "1", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert [r["size_mb"] for r in document["reads"]] == [1, 4]
    for row in document["reads"]:  # rate = bytes over the best pass, whatever the machine's speed
        assert row["gb_s"] == pytest.approx(row["size_mb"] * 2**20 / (row["best_ms"] / 1e3) / 1e9, rel=1e-6)
    assert document["machine"]["cores"] >= 1 and document["threads"] == 1


def test_bad_sizes_are_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        membw.main(["--sizes-mb", "0"])
    assert exc.value.code == 2
