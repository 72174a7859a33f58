"""No module of the package is longer than 500 lines (split by role instead, see STYLE.md)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500


def module_lengths() -> dict[str, int]:
    """Every ``.py`` file under spark_estimators/ and its number of lines."""
    return {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in sorted((ROOT / "spark_estimators").rglob("*.py"))
    }


def test_the_count_sees_the_package():
    lengths = module_lengths()
    assert lengths["spark_estimators/__init__.py"] > 10
    assert len(lengths) > 100


def test_no_module_is_longer_than_500_lines():
    too_long = {path: n for path, n in module_lengths().items() if n > MAX_LINES}
    assert too_long == {}
