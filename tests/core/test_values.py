"""The shared predicates for integers and finite numbers: bools are neither, numpy's count."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from rftgym.core.values import int_tuple, is_finite_real, is_int


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int64(5), np.uint8(7), np.int32(-1)])
def test_integers_of_python_and_numpy_are_ints(value):
    assert is_int(value) and is_finite_real(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, np.float64(2.0), "3", None, [1]])
def test_bools_floats_and_text_are_not_ints(value):
    assert not is_int(value)


def test_int_tuples_take_ints_and_decimal_text_only():
    assert int_tuple(3) == (3,) and int_tuple("2") == (2,) and int_tuple([1, "2", np.int64(3)]) == (1, 2, 3)
    for bad in (1.5, True, [2.7], ["x"], [None], None):
        with pytest.raises(TypeError):
            int_tuple(bad)


@pytest.mark.parametrize("value", [0.5, -1e300, np.float32(0.25), np.float64(3.0), Fraction(1, 3)])
def test_finite_reals(value):
    assert is_finite_real(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), np.float32("nan"), np.float64("inf"),
                                   True, np.bool_(False), "1.5", None, 1 + 0j, np.complex64(1), 10**400, -(10**400)])
def test_not_finite_reals(value):
    assert not is_finite_real(value)
