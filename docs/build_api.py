"""Build the API reference (HTML) from the package's docstrings with pdoc; warnings are errors.

Usage::

    python docs/build_api.py                 # writes build/api/index.html
    python docs/build_api.py -o /tmp/api     # elsewhere

Why pdoc: it renders numpydoc docstrings and type annotations straight from the imported modules,
needs one small package (``pip install pdoc``) and no configuration tree, and builds the whole
reference in seconds (importing TensorFlow for the Keras pages is most of the time).

Warnings as errors: every warning that pdoc raises about our modules (an import that fails, an
annotation it cannot resolve, a docstring it cannot parse) fails the build and is listed. Known
warnings that are not about our docs are ignored (see :data:`IGNORED_WARNINGS`): pyspark's
``Params`` annotations that exist only under ``TYPE_CHECKING`` (pdoc meets them in the members our
estimators inherit), and pdoc's notice that it hides a default equal to an environment variable.
Warnings that third-party packages emit while being imported (deprecations in TensorFlow, ...)
are not pdoc's and are ignored too.

Framework pages (torch, lightning, keras) are built when their framework is installed; a missing
framework is reported and, with ``--require-frameworks``, fails the build.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import warnings
from pathlib import Path

#: The modules the reference documents, in reading order. A package page lists what its
#: ``__all__`` exports (``spark_estimators.run``, ``spark_estimators.torch.TorchEstimator``, ...).
PUBLIC_MODULES = [
    "spark_estimators",
    "spark_estimators.runner",
    "spark_estimators.launch",
    "spark_estimators.run_options",
    "spark_estimators.errors",
    "spark_estimators.envvars",
    "spark_estimators.store",
    "spark_estimators.data",
    "spark_estimators.collective",
    "spark_estimators.collective.torch",
    "spark_estimators.collective.keras",
    "spark_estimators.collective.api.timeline",
    "spark_estimators.collective.backends",
    "spark_estimators.core.backend",
    "spark_estimators.core.session",
    "spark_estimators.core.estimator",
    "spark_estimators.core.model",
    "spark_estimators.task",
    "spark_estimators.elastic",
    "spark_estimators.collective.api.elastic",
    "spark_estimators.torch",
    "spark_estimators.lightning",
    "spark_estimators.keras",
]

#: Module -> the packages it needs beyond the core dependencies.
FRAMEWORKS = {
    "spark_estimators.collective.torch": ("torch",),
    "spark_estimators.torch": ("torch",),
    "spark_estimators.lightning": ("torch", "pytorch_lightning"),
    "spark_estimators.collective.keras": ("tensorflow", "keras"),
    "spark_estimators.keras": ("tensorflow", "keras"),
}

#: Warnings about third-party code that pdoc raises while documenting our subclasses.
IGNORED_WARNINGS = [
    # pyspark.ml.param.Params annotates _paramMap/_defaultParamMap with a TYPE_CHECKING-only name.
    re.compile(r"'ParamMap' type annotation for pyspark\."),
    re.compile(r"type annotation 'ParamMap' for pyspark\."),
    # pdoc hides a default value that equals an environment variable (SPARK_LOCAL_IP=127.0.0.1 in
    # the tests), and says so; the page is still complete.
    re.compile(r"matches the \$\w+ environment variable"),
]

REPO_ROOT = Path(__file__).resolve().parent.parent


def missing_frameworks(module: str) -> list[str]:
    return [name for name in FRAMEWORKS.get(module, ()) if importlib.util.find_spec(name) is None]


def _is_pdoc_or_ours(filename: str) -> bool:
    import pdoc

    pdoc_dir = str(Path(pdoc.__file__).resolve().parent)
    ours = str(REPO_ROOT / "spark_estimators")
    path = str(Path(filename).resolve()) if filename else ""
    return path.startswith(pdoc_dir) or path.startswith(ours)


def build(output: Path, require_frameworks: bool = False) -> tuple[list[str], list[str]]:
    """Render the reference into ``output``; return (problems, skipped modules)."""
    # pdoc blocks subprocesses while importing modules; TensorFlow's import asks `uname -p`.
    os.environ.setdefault("PDOC_ALLOW_EXEC", "1")
    import pdoc
    import pdoc.render

    problems: list[str] = []
    modules, skipped = [], []
    for module in PUBLIC_MODULES:
        missing = missing_frameworks(module)
        if missing:
            skipped.append(f"{module} (needs {', '.join(missing)})")
            if require_frameworks:
                problems.append(f"{module}: {', '.join(missing)} not installed")
        else:
            modules.append(module)

    pdoc.render.configure(docformat="numpy", show_source=False, footer_text="spark_estimators")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=output)
    for w in caught:
        message = str(w.message)
        if not _is_pdoc_or_ours(w.filename):
            continue
        if any(p.search(message) for p in IGNORED_WARNINGS):
            continue
        problems.append(f"{w.category.__name__}: {message}")
    for module in modules:
        page = output / (module.replace(".", "/") + ".html")
        if not page.is_file():
            problems.append(f"{module}: page {page} was not written")
    return problems, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=str(REPO_ROOT / "build" / "api"))
    parser.add_argument(
        "--require-frameworks",
        action="store_true",
        help="fail when torch, lightning or keras is missing (default: skip their pages)",
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("pdoc") is None:
        print("pdoc is not installed: pip install pdoc", file=sys.stderr)
        return 2
    output = Path(args.output)
    problems, skipped = build(output, require_frameworks=args.require_frameworks)
    for module in skipped:
        print(f"skipped {module}", file=sys.stderr)
    if problems:
        print(f"API reference: {len(problems)} problem(s), warnings are errors:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"API reference written to {output / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
