"""`{% bar_fill %}`: a bar's filled share as SVG geometry, always a number from 0 to 100."""

from __future__ import annotations

import pytest

from controlplane.templatetags.console import bar_fill, percent_of


@pytest.mark.parametrize("value", ["nan", float("nan"), "-nan"])
def test_a_share_that_is_not_a_number_draws_an_empty_bar(value):
    """Before, NaN passed the clamp (`max(nan, 0.0)` is NaN) and the bar was `<rect width="nan">`: an SVG attribute
    error Chromium logs on the page, and a 'share' outside 0–100."""
    assert percent_of(value, 100) == 0.0 and percent_of(50, value) == 0.0
    assert '<rect width="0.0"' in bar_fill(value)


@pytest.mark.parametrize(("value", "drawn"), [(40, "40.0"), (-5, "0.0"), (250, "100.0"), (float("inf"), "100.0"),
                                              (None, "0.0"), ('"><script>', "0.0")])
def test_a_share_is_clamped_to_the_bar(value, drawn):
    assert f'<rect width="{drawn}"' in bar_fill(value)
