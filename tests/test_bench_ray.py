"""benchmarks.ray_bench's setups: every proxy setup is compared with a plain server of the same threads."""

from __future__ import annotations

from benchmarks.ray_bench import DEFAULT_SETUPS, SETUPS, build_parser


def test_every_setup_has_a_plain_baseline_with_its_threads() -> None:
    by_name = {s.name: s for s in SETUPS}
    for setup in SETUPS:
        baseline = by_name[setup.baseline]
        assert baseline.replicas == 0 and baseline.threads == setup.threads
    assert by_name["proxy-1x1"].baseline == "plain-1"


def test_replica_setups_pass_their_threads_and_plain_ones_need_no_ray() -> None:
    by_name = {s.name: s for s in SETUPS}
    replica = by_name["proxy-1x1"].argv("continuous", 8, None)
    assert "api.ray_serve" in replica and replica[replica.index("--cpus-per-replica") + 1] == "1"
    assert "api.ray_serve" not in by_name["plain-1"].argv("continuous", 8, None)


def test_the_issue_s_three_setups_are_the_default() -> None:
    assert build_parser().parse_args(["--out", "x"]).setups.split(",") == list(DEFAULT_SETUPS)
    assert set(DEFAULT_SETUPS) <= {s.name for s in SETUPS}
