"""bench serve's arrival schedules: rate and burstiness give the right gap mean and coefficient of
variation over a seeded sample, the schedule spans N / rate, ramps and inf behave."""
from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.arrivals import ArrivalSchedule

N = 20_000  # gaps per sample: the mean and CV below are within ~2-3% at this size


def _gaps(schedule: ArrivalSchedule) -> np.ndarray:
    return np.diff(schedule.times(N))


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_gaps_have_mean_one_over_rate_and_cv_one(rate):
    gaps = _gaps(ArrivalSchedule(rate, burstiness=1.0, seed=1))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 4.0])
def test_burstiness_sets_cv_to_one_over_sqrt_shape_and_keeps_the_mean(burstiness):
    gaps = _gaps(ArrivalSchedule(2.0, burstiness=burstiness, seed=7))
    assert gaps.mean() == pytest.approx(0.5, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.04)


def test_schedule_spans_n_over_rate_starts_at_zero_and_never_goes_back():
    times = ArrivalSchedule(8.0, seed=3).times(N)
    assert times[0] == 0.0
    assert np.all(np.diff(times) >= 0)
    assert times[-1] == pytest.approx(N / 8.0, rel=0.03)


def test_same_seed_same_times_other_seed_other_times():
    a, b = ArrivalSchedule(2.0, seed=5).times(100), ArrivalSchedule(2.0, seed=5).times(100)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, ArrivalSchedule(2.0, seed=6).times(100))


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(ArrivalSchedule(math.inf).times(10), np.zeros(10))


def test_linear_and_exponential_ramps_go_from_start_rate_to_rate():
    lin = ArrivalSchedule(10.0, ramp="linear", ramp_start_rate=1.0).rates(5)
    assert lin.tolist() == pytest.approx([1.0, 3.25, 5.5, 7.75, 10.0])
    exp = ArrivalSchedule(100.0, ramp="exponential", ramp_start_rate=1.0).rates(3)
    assert exp.tolist() == pytest.approx([1.0, 10.0, 100.0])
    # the ramp's gaps shrink: the second half of a ramp-up arrives much faster than the first
    gaps = np.diff(ArrivalSchedule(20.0, ramp="linear", ramp_start_rate=1.0, seed=2).times(2000))
    assert gaps[:500].mean() > 3 * gaps[-500:].mean()


@pytest.mark.parametrize("fields, name", [
    (dict(rate=0.0), "request_rate"), (dict(rate=-1.0), "request_rate"),
    (dict(rate=1.0, burstiness=0.0), "burstiness"), (dict(rate=1.0, ramp="sideways"), "ramp"),
    (dict(rate=math.inf, ramp="linear"), "ramp_start_rate"),
])
def test_bad_load_shape_is_a_value_error_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        ArrivalSchedule(**fields)
