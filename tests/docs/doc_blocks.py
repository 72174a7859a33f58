"""The Python code blocks of docs/*.md and README.md, and a runner for one page's blocks.

The rule (issue 41): every ```` ```python ```` block runs as written, in page order, all blocks of a
page in one fresh namespace, as a reader pasting them into one notebook would.
The namespace starts with what a notebook gives: ``spark``, a local[2] SparkSession (a page's
own ``SparkSession.builder.master("local[2]").getOrCreate()`` returns that same session).

A block that cannot run that way carries a visible marker on the line before its fence, with the
reason in parentheses, and is counted:

- ``<!-- docs-test: skip (needs a GPU) -->``: a complete example that needs what this machine
  lacks (a GPU, DBFS, S3/HDFS, more task slots, Databricks);
- ``<!-- docs-test: fragment (the body of a training function) -->``: not a program: a
  signature, a method, ``...`` standing for the reader's own arguments or data.

Other fences (shell commands, diagrams, side-by-side comparisons) are fenced as ``text``,
``bash`` or without a language, and are not Python blocks.

Run pages: ``python tests/docs/doc_blocks.py docs/elastic.md README.md`` (from any working
directory: the pages' files land there). The pages run one after the other in this one process
(one JVM start for all; each page still has a namespace of its own). It prints
``DOCS-BLOCK <page>:<line> ok <seconds>`` per block, or ``failed`` and the traceback.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE_RE = re.compile(r"^```(?P<lang>[^\s`]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
MARKER_RE = re.compile(
    r"^<!--\s*docs-test:\s*(?P<kind>skip|fragment)\s*\((?P<reason>.+)\)\s*-->\s*$"
)
ANY_MARKER_RE = re.compile(r"docs-test:")
PYTHON = ("python", "py", "python3")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code and what the test does with it."""

    page: str  # relative to the repository root
    line: int  # line number of the block's first code line
    code: str
    status: str  # "run" | "skip" | "fragment"
    reason: str = ""


def pages() -> list[Path]:
    """Every page whose blocks the test runs: docs/*.md and README.md."""
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def blocks(page: Path) -> list[Block]:
    """The page's Python blocks in order, each with its marker's status (default "run")."""
    text = page.read_text()
    lines = text.splitlines()
    name = page.relative_to(ROOT).as_posix()
    found = []
    for match in FENCE_RE.finditer(text):
        if match.group("lang").lower() not in PYTHON:
            continue
        fence_line = text.count("\n", 0, match.start())  # 0-based index of the fence line
        previous = next((ln for ln in reversed(lines[:fence_line]) if ln.strip()), "")
        marker = MARKER_RE.match(previous.strip())
        status, reason = ("run", "") if marker is None else (marker["kind"], marker["reason"])
        found.append(Block(name, fence_line + 2, match.group("code"), status, reason))
    return found


def stray_markers(page: Path) -> list[int]:
    """Lines with a ``docs-test:`` marker that is malformed or not right before a Python fence."""
    lines = page.read_text().splitlines()
    bad = []
    for i, line in enumerate(lines):
        if not ANY_MARKER_RE.search(line):
            continue
        following = next((ln.strip() for ln in lines[i + 1 :] if ln.strip()), "")
        fence = re.match(r"```([^\s`]*)", following)
        if not MARKER_RE.match(line.strip()) or fence is None or fence[1].lower() not in PYTHON:
            bad.append(i + 1)
    return bad


def run_page(page: Path) -> bool:
    """Run the page's blocks marked "run", in order, in one namespace; False if one raised.

    The namespace starts with ``spark`` (a local[2] session, a new one if an earlier page
    stopped it). Each block's outcome is printed as a ``DOCS-BLOCK`` line; a block that raises
    prints its traceback (line numbers are the page's) and ends the page.
    """
    import traceback

    from spark_estimators.core.session import create_local_session

    namespace: dict[str, object] = {"__name__": "__main__"}
    namespace["spark"] = create_local_session("local[2]")
    for block in blocks(page):
        if block.status != "run":
            continue
        started = time.perf_counter()
        try:
            code = compile("\n" * (block.line - 1) + block.code, block.page, "exec")
            exec(code, namespace)  # noqa: S102 - the docs' code is the point of the test
        except BaseException:  # noqa: BLE001 - reported, and the next page still runs
            print(f"DOCS-BLOCK {block.page}:{block.line} failed", flush=True)
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
            return False
        seconds = time.perf_counter() - started
        print(f"DOCS-BLOCK {block.page}:{block.line} ok {seconds:.1f}", flush=True)
    return True


def main(argv: list[str]) -> int:
    """Run each page given (in this process, one after the other); exit 1 if any failed."""
    failed = [page for page in argv if not run_page(Path(page).resolve())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
