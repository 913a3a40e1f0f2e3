"""The interval math: mean ± t_{0.975, n-1} s / sqrt(n), against hand computations and t tables."""
import math

import pytest

from eval.stats import t_interval, t_quantile


def test_interval_of_four_values_matches_a_hand_computation():
    # 1, 2, 3, 4: mean 2.5; s^2 = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3; se = s / 2; t_{0.975, 3} = 3.182446 (table)
    estimate = t_interval([1.0, 2.0, 3.0, 4.0])
    assert estimate.mean == 2.5
    assert estimate.half_width == pytest.approx(3.182446 * math.sqrt(5 / 3) / 2, rel=1e-6)
    assert (estimate.low, estimate.high) == pytest.approx((2.5 - 2.054260, 2.5 + 2.054260), abs=1e-5)


@pytest.mark.parametrize("degrees, table_value", [(1, 12.706205), (2, 4.302653), (9, 2.262157), (29, 2.045230)])
def test_t_quantile_matches_tables(degrees, table_value):
    assert t_quantile(0.975, degrees) == pytest.approx(table_value, rel=1e-6)


def test_three_seeds_use_two_degrees_of_freedom():
    # 0.2, 0.4, 0.9: mean 0.5, s^2 = (0.09 + 0.01 + 0.16) / 2 = 0.13
    estimate = t_interval([0.2, 0.4, 0.9])
    assert estimate.mean == pytest.approx(0.5)
    assert estimate.half_width == pytest.approx(4.302653 * math.sqrt(0.13 / 3), rel=1e-6)
    assert estimate.to_json()["n"] == 3


def test_one_seed_has_no_interval_and_equal_values_a_zero_one():
    assert t_interval([0.7]).half_width is None
    assert t_interval([0.7]).format() == "0.700"
    assert t_interval([0.5, 0.5, 0.5]).half_width == 0.0


def test_no_values_is_an_error():
    with pytest.raises(ValueError):
        t_interval([])
