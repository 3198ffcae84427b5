"""Test modules outside a package have names of their own: pytest imports them by their file name
(rootdir conftest, no __init__.py), so two test files of one name stop the collection of the whole
suite ("import file mismatch"), which running either folder alone never shows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_two_test_modules_outside_a_package_share_a_name() -> None:
    loose = [p for p in (ROOT / "tests").rglob("test_*.py") if not (p.parent / "__init__.py").exists()]
    twice = {name: n for name, n in Counter(p.name for p in loose).items() if n > 1}
    assert len(loose) > 50 and not twice, twice
