"""The demo's comparison says whether pretraining helps from the numbers, including when it does not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "digits_compare", Path(__file__).parents[2] / "examples" / "digits" / "compare.py"
)
assert spec is not None and spec.loader is not None
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def test_verdict_reports_help_only_beyond_two_standard_errors():
    assert compare.verdict([0.90, 0.91, 0.92], [0.85, 0.86, 0.87]).startswith("pretraining helps here: +5.0 points")
    assert compare.verdict([0.85, 0.86, 0.87], [0.90, 0.91, 0.92]).startswith("pretraining hurts here")
    same = compare.verdict([0.879, 0.875, 0.883], [0.875, 0.863, 0.887])
    assert same.startswith("no clear difference on test: +0.4 points")
    assert "does not measurably help" in same
    assert "one seed each" in compare.verdict([0.9], [0.8])
