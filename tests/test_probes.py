"""grpo/checks/probes.py: a bounded check passes at its bound and fails above it and on NaN."""

from __future__ import annotations

import math

import pytest

from grpo.checks.probes import bounded


@pytest.mark.parametrize(("value", "status"), [(0.0, "pass"), (1e-6, "pass"), (1.0000001e-6, "fail"),
                                               (math.inf, "fail"), (math.nan, "fail")])
def test_a_bounded_check_passes_up_to_its_bound_and_never_on_nan(value, status):
    check = bounded("first_step", "I8, I9", value, 1e-6, "detail", "the fix")
    assert check.status == status and check.passed == (status == "pass")
    assert check.hint == ("" if status == "pass" else "the fix") and check.bound == 1e-6
