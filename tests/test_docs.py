"""The docs stay readable and true to the tree: sizes, relative links that resolve, and a results folder that holds
what the docs cite and says which doc cites each entry."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README_MAX_BYTES = 12_000
DOC_MAX_BYTES = 25_000
RESULTS_MAX_TRACKED_BYTES = 8_000_000
MARKDOWN = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").rglob("README.md")])


def test_readme_is_a_landing_page() -> None:
    assert (ROOT / "README.md").stat().st_size <= README_MAX_BYTES


@pytest.mark.parametrize("doc", sorted((ROOT / "docs").rglob("*.md")), ids=lambda path: path.name)
def test_each_doc_stays_short(doc: Path) -> None:
    assert doc.stat().st_size <= DOC_MAX_BYTES


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    targets = re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
    local = [target.split("#")[0] for target in targets if not re.match(r"[a-z]+:|#", target)]
    assert [target for target in local if target and not (doc.parent / target).exists()] == []


def test_results_readme_maps_every_entry() -> None:
    index = (RESULTS / "README.md").read_text()
    entries = sorted(path.name for path in RESULTS.iterdir() if path.name != "README.md")
    assert [name for name in entries if f"`{name}" not in index] == []


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="needs the git checkout")
def test_results_tree_stays_small() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    sizes = [(ROOT / name).stat().st_size for name in tracked if name and (ROOT / name).exists()]
    assert sizes and sum(sizes) <= RESULTS_MAX_TRACKED_BYTES


# A path a command writes (`--out`, `R=`) or a placeholder is not a citation; every other results path a doc names
# is one, and must be there.
_WRITTEN = re.compile(r"(?:--out|--cost-model|--replay|R=)\s*=?\s*benchmarks/results/\S+")
_CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_./-]*[A-Za-z0-9_/]")


def cited_results(text: str) -> set[str]:
    return {path.rstrip("/") for path in _CITED.findall(_WRITTEN.sub("", text))}


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_result_a_doc_cites_exists(doc: Path) -> None:
    assert sorted(path for path in cited_results(doc.read_text()) if not (ROOT / path).exists()) == []


def provenance_files(cited: str) -> list[Path]:
    """The JSON files that say where a cited result came from: the file itself, every JSON file under a cited folder
    (but its raw/ records, which the result beside them describes), or, for a report, plot or log, the JSON files
    beside it."""
    path = ROOT / cited
    if path.is_dir():
        return sorted(found for found in path.rglob("*.json") if "raw" not in found.relative_to(path).parts)
    return [path] if path.suffix == ".json" else sorted(path.parent.glob("*.json"))


def lacks_provenance(path: Path) -> bool:
    """Whether a result file fails to record the commit it measured and the CPU cap it ran under (machine_facts()'s
    `commit` and `cpu_cap`; for runs from before machine_facts() recorded them, recovered from git and marked so)."""
    document = json.loads(path.read_text())
    machine = document.get("machine") if isinstance(document, dict) else None
    return not (isinstance(machine, dict) and machine.get("commit") and isinstance(machine.get("cpu_cap"), dict))


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_result_a_doc_cites_records_its_commit_and_cpu_cap(doc: Path) -> None:
    cited = [path for path in cited_results(doc.read_text()) if path != "benchmarks/results/README.md"]
    unrecorded = [f"{path}: no result file" for path in cited if not provenance_files(path)]
    unrecorded += [
        str(found.relative_to(ROOT)) for path in cited for found in provenance_files(path) if lacks_provenance(found)
    ]
    assert sorted(set(unrecorded)) == []


def test_a_result_without_commit_or_cap_is_caught(tmp_path: Path) -> None:
    machine = {"cpu": "AMD EPYC", "commit": "f3dab9d", "cpu_cap": {}}
    for document, lacking in (
        ({"machine": machine}, False),
        ({"machine": {**machine, "commit": None}}, True),
        ({"machine": {key: value for key, value in machine.items() if key != "cpu_cap"}}, True),
        ({"requests": []}, True),
    ):
        (tmp_path / "result.json").write_text(json.dumps(document))
        assert lacks_provenance(tmp_path / "result.json") is lacking


def test_a_written_path_is_not_a_citation() -> None:
    text = "run `x --out benchmarks/results/new-run` then read `benchmarks/results/old-run/result.json`."
    assert cited_results(text) == {"benchmarks/results/old-run/result.json"}


def test_no_merge_conflict_markers_are_left_in_the_tree() -> None:
    """A merge resolved in haste once left `<<<<<<<` blocks in a doc that every other check passed."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<{7}|>{7}) ", re.MULTILINE)
    texts = [name for name in tracked if name.endswith((".py", ".md", ".cpp", ".h", ".toml", ".sh", ".txt", ".json"))]
    assert [name for name in texts if (ROOT / name).is_file() and marker.search((ROOT / name).read_text())] == []
