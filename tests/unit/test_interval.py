"""Young/Daly's checkpoint interval: the seed's example and the arithmetic around it."""
import pytest

from alpha_ckpt.runtime.interval import parse_duration, young_daly


def test_the_seed_example_sixty_seconds_and_six_hours_gives_27_minutes_3_7_percent_and_13_minutes():
    plan = young_daly(60, 6 * 3600)
    assert plan.interval_s == pytest.approx(1609.97, abs=0.01)   # sqrt(2 x 60 x 21,600) = sqrt(2,592,000)
    assert round(plan.interval_s / 60) == 27
    assert round(100 * plan.overhead, 1) == 3.7
    assert int(plan.expected_redo_s // 60) == 13                 # about 13 minutes (13.4)
    assert "26.8 min" in plan.describe() and "3.7 %" in plan.describe() and "13.4 min" in plan.describe()


def test_interval_in_updates_is_rounded_up_and_never_shorter_than_one_save():
    plan = young_daly(60, 21600)
    assert plan.every_updates(update_s=10.0) == 161
    assert plan.every_updates(update_s=10.0, floor_s=5000.0) == 500
    assert young_daly(0.0, 100).every_updates(update_s=1.0) == 1


@pytest.mark.parametrize("text, seconds", [("21600", 21600), ("21600s", 21600), ("360m", 21600), ("6h", 21600),
                                           ("0.25d", 21600), ("1.5h", 5400)])
def test_durations_take_seconds_minutes_hours_and_days(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-1h", "6 hours", "h", "nan"])
def test_a_duration_that_is_not_positive_is_refused(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_a_cost_or_mtbf_out_of_range_is_refused():
    for cost, mtbf in [(-1, 10), (1, 0), (float("inf"), 10)]:
        with pytest.raises(ValueError):
            young_daly(cost, mtbf)
