"""The user docs and the API reference: the reference builds with warnings as errors, key pages
exist, links between the Markdown pages resolve, and troubleshooting covers every error class and
every module that raises."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "spark_estimators"

LINK_RE = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@pytest.fixture(scope="module")
def api_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("pdoc") is None:
        pytest.skip("pdoc is not installed (pip install pdoc): the API reference is not built")
    out = tmp_path_factory.mktemp("api")
    proc = subprocess.run(
        [sys.executable, str(DOCS / "build_api.py"), "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"API build failed:\n{proc.stderr[-5000:]}"
    return out


@pytest.mark.timeout(600)
def test_api_reference_has_the_key_pages(api_dir: Path) -> None:
    assert (api_dir / "index.html").is_file()
    top = (api_dir / "spark_estimators.html").read_text()
    assert 'id="run"' in top
    assert "num_proc" in top and "TrainingFailedError" in top
    assert 'id="Store"' in top
    errors = (api_dir / "spark_estimators" / "errors.html").read_text()
    assert 'id="TrainingFailedError"' in errors
    assert "worker_failures" in errors


@pytest.mark.timeout(600)
def test_api_reference_has_the_torch_pages(api_dir: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: its pages are not built")
    estimator = (api_dir / "spark_estimators" / "torch.html").read_text()
    assert 'id="TorchEstimator"' in estimator
    assert 'id="TorchModel"' in estimator
    collective = (api_dir / "spark_estimators" / "collective" / "torch.html").read_text()
    assert 'id="DistributedOptimizer"' in collective
    assert 'id="broadcast_parameters"' in collective


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else HEADING_RE.match(line)
        if m:
            anchors.add(_slug(m.group(2)))
    return anchors


def _links(path: Path) -> list[str]:
    links, in_code = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            links.extend(LINK_RE.findall(line))
    return links


def test_markdown_links_resolve() -> None:
    pages = sorted(DOCS.glob("*.md"))
    assert {"index.md", "concepts.md", "migration.md", "troubleshooting.md", "databricks.md"} <= {
        p.name for p in pages
    }
    broken = []
    for page in pages:
        for link in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.name}: {link} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_index_links_every_page_and_notebook() -> None:
    index = (DOCS / "index.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"({page.name}" in index, f"docs/index.md does not link {page.name}"
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        assert f"notebooks/{notebook.name}" in index, f"docs/index.md omits {notebook.name}"


def _raising_modules() -> dict[str, int]:
    """Dotted module name -> number of ``raise SomethingError(...)`` statements in it."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        count = 0
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name.endswith(("Error", "Exception", "Interrupt")) or name in ("_bad",):
                    count += 1
        if count:
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[module.removesuffix(".__init__")] = count
    return found


def test_troubleshooting_names_every_error_class() -> None:
    from spark_estimators import errors

    text = (DOCS / "troubleshooting.md").read_text()
    missing = [name for name in errors.__all__ if f"`{name}`" not in text]
    assert not missing, f"docs/troubleshooting.md does not explain {missing}"


def test_troubleshooting_covers_every_module_that_raises() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    modules = _raising_modules()
    assert "spark_estimators.runner" in modules  # the scan itself works

    def covered(module: str) -> bool:
        # A section may cover a whole subpackage (`spark_estimators.torch` covers its modules).
        parts = module.split(".")
        names = {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        return any(f"`{name}`" in text for name in names)

    missing = sorted(m for m in modules if not covered(m))
    assert not missing, (
        "docs/troubleshooting.md has no section for these modules that raise errors; list their "
        f"messages with cause and fix: {missing}"
    )
