"""Prints the counts of the docs' Python blocks (run / skipped / fragments) after a run that
included tests/docs/test_doc_code_blocks.py (issue 41)."""

from __future__ import annotations

from collections import Counter

import pytest
from doc_blocks import blocks, pages

_ran_docs_blocks: list[bool] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if any(item.nodeid.split("::")[0].endswith("test_doc_code_blocks.py") for item in items):
        _ran_docs_blocks.append(True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _ran_docs_blocks:
        return
    all_blocks = [b for p in pages() for b in blocks(p)]
    counts = Counter(b.status for b in all_blocks)
    terminalreporter.section("docs code blocks")
    terminalreporter.write_line(
        f"{len(all_blocks)} python blocks in docs/*.md and README.md: {counts['run']} run, "
        f"{counts['skip']} skipped (cannot run here), {counts['fragment']} fragments"
    )
    for b in all_blocks:
        if b.status != "run":
            terminalreporter.write_line(f"  {b.status:8} {b.page}:{b.line} ({b.reason})")
