"""The open-loop arrival process: reproducible, right mean rate, burstiness shapes the variance."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.loadgen.arrivals import ArrivalConfig, arrival_offsets, inter_arrival_gaps

N = 20_000


def test_same_seed_same_arrivals_different_seed_different_arrivals() -> None:
    a = inter_arrival_gaps(ArrivalConfig(request_rate=4.0, seed=11), 100)
    assert a == inter_arrival_gaps(ArrivalConfig(request_rate=4.0, seed=11), 100)
    assert a != inter_arrival_gaps(ArrivalConfig(request_rate=4.0, seed=12), 100)


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate(rate: float, burstiness: float) -> None:
    gaps = inter_arrival_gaps(ArrivalConfig(request_rate=rate, burstiness=burstiness, seed=1), N)
    # The standard error of the mean is (1/rate)/sqrt(burstiness * N); allow six of them.
    tolerance = 6 / (rate * math.sqrt(burstiness * N))
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, abs=tolerance)
    assert all(g >= 0 for g in gaps)


def test_poisson_gaps_have_unit_coefficient_of_variation() -> None:
    gaps = inter_arrival_gaps(ArrivalConfig(request_rate=2.0, burstiness=1.0, seed=5), N)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1.0, abs=0.05)


def test_lower_burstiness_means_higher_variance_at_the_same_rate() -> None:
    def variance(burstiness: float) -> float:
        return statistics.pvariance(inter_arrival_gaps(ArrivalConfig(2.0, burstiness, seed=3), N))

    bursty, poisson, smooth = variance(0.25), variance(1.0), variance(4.0)
    assert bursty > poisson > smooth
    # Gamma variance is 1 / (rate^2 * shape): 1.0, 0.25 and 0.0625 here.
    assert bursty == pytest.approx(1.0, rel=0.2)
    assert smooth == pytest.approx(0.0625, rel=0.2)


def test_infinite_rate_sends_everything_at_once() -> None:
    config = ArrivalConfig(request_rate=math.inf, seed=9)
    assert inter_arrival_gaps(config, 7) == [0.0] * 7
    assert arrival_offsets(config, 7) == [0.0] * 7


def test_offsets_are_cumulative_gaps() -> None:
    config = ArrivalConfig(request_rate=3.0, seed=2)
    gaps = inter_arrival_gaps(config, 5)
    offsets = arrival_offsets(config, 5)
    assert offsets == pytest.approx([sum(gaps[: i + 1]) for i in range(5)])
    assert offsets == sorted(offsets)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"request_rate": 0.0}, "request_rate must be > 0"),
        ({"request_rate": -1.0}, "request_rate must be > 0"),
        ({"request_rate": math.nan}, "request_rate must be > 0"),
        ({"burstiness": 0.0}, "burstiness must be a positive finite number"),
    ],
)
def test_invalid_configs_are_rejected(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ArrivalConfig(**kwargs)  # type: ignore[arg-type]
