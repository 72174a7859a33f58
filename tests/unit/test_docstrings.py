"""Every public def and class of the package has a docstring (issue 19's acceptance).

Public: not under a ``_private`` module or package, its own name and its enclosing classes' names
without a leading underscore. Functions nested in functions are not API and are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "spark_estimators"

#: Modules being rewritten by other issue-19 work; remove an entry once its module passes.
PENDING: set[str] = set()


def _undocumented(path: Path, root: Path = PACKAGE) -> list[str]:
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if child.name.startswith("_"):
                continue
            decorators = [ast.unparse(d) for d in child.decorator_list]
            exempt = any("overload" in d or d.endswith(".setter") for d in decorators)
            if ast.get_docstring(child) is None and not exempt:
                found.append(f"{path.relative_to(root)}:{child.lineno} {prefix}{child.name}")
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return found


def test_every_public_def_has_a_docstring():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.as_posix() in PENDING:
            continue
        if any(part.startswith("_") and part != "__init__.py" for part in relative.parts):
            continue
        missing.extend(_undocumented(path))
    assert not missing, "public defs without a docstring:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_docstring(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        'class A:\n    """Doc."""\n\n    def f(self):\n        return 1\n\n'
        "    def _g(self):\n        return 2\n\n"
        'def h():\n    """Doc."""\n'
    )
    assert _undocumented(source, root=tmp_path) == ["mod.py:4 A.f"]
