"""Every notebook in notebooks/ runs top to bottom in a real Jupyter kernel.

Each notebook checks its own results with ``assert`` cells (a metric bound, not just "it ran"),
so a failing assert fails its test here. The kernel is this interpreter's ``python3`` kernel
(ipykernel), started in the repository root; notebooks start their own local Spark session.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 900

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess]

# What a fresh-clone notebook run must not show (issue 27): each pattern is searched in every
# line of every stream output (stdout and stderr) of every code cell.
NOISE = {
    # Python warnings, log4j/JVM WARN lines, tqdm's "IProgress not found".
    "warning": re.compile(r"[A-Za-z]*Warning\b|\bWARN(ING)?\b|IProgress"),
    # Spark 4's start-up lines (JVM module note, log4j profile, log level, hadoop natives).
    "spark banner": re.compile(
        r"Using incubator modules|Using Spark's default log4j profile|Setting default log level"
        r"|To adjust logging level use sc\.setLogLevel|NativeCodeLoader"
    ),
    # Spark's console stage bar: "[Stage 4:=====>   (3 + 2) / 8]".
    "spark stage bar": re.compile(r"\[Stage \d+:"),
    # TensorFlow's start-up lines (absl before InitializeLog, oneDNN, CPU features).
    "tensorflow": re.compile(
        r"absl::InitializeLog|oneDNN custom operations|cpu_feature_guard"
        r"|This TensorFlow binary is optimized"
    ),
    # Lightning's banner on rank 0 (verbose=1 shows epoch lines only).
    "lightning banner": re.compile(
        r"GPU available: |TPU available: |HPU available: |Initializing distributed: "
        r"|distributed_backend=|All distributed processes registered|`Trainer\.fit` stopped"
        r"|LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES|💡 Tip"
    ),
}
# Spark's stage bar with other text written right after it on the same line.
BAR_THEN_TEXT = re.compile(r"\(\d+ \+ \d+\) / \d+\](?!\[Stage|\s|$)")
# ipykernel forwards the JVM's and the Python workers' stderr (fd 2) into cell outputs, as in a
# user's notebook, except under pytest (it checks PYTEST_CURRENT_TEST): hide that variable.
KERNEL_ENV = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


#: Under autologging, MLflow's own warnings about the user's other pyspark.ml stages (a feature
#: Pipeline the notebook fits: a DateType input, a dataset schema it cannot infer) are MLflow's
#: output, not ours; every other line is checked as without autologging.
MLFLOW_LOG_LINE = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d WARNING mlflow\.")


def output_problems(nb, stage_bar_on: bool = False, autolog: bool = False) -> list[str]:
    """Lines matching NOISE, blank stderr blocks, and lines where text follows Spark's bar.

    ``stage_bar_on``: the notebook turned Spark's stage bar on itself; its redraws (and the
    blank blocks that clear them) are then expected. ``autolog``: MLflow's own warning lines
    (:data:`MLFLOW_LOG_LINE`) are left out.
    """
    problems = []
    allowed = {"spark stage bar"} if stage_bar_on else set()
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        streams = [o for o in cell.outputs if o.get("output_type") == "stream"]
        text = "".join(o.get("text", "") for o in streams)
        for line in text.replace("\r", "\n").splitlines():
            if autolog and MLFLOW_LOG_LINE.search(line):
                continue
            for name, pattern in NOISE.items():
                if name not in allowed and pattern.search(line):
                    problems.append(f"code cell {i}, {name}: {line[:300]}")
        if not stage_bar_on:
            blank = [o for o in streams if o.get("name") == "stderr" and not o["text"].strip()]
            if blank:
                problems.append(f"code cell {i}: {len(blank)} blank stderr block(s)")
        for raw in text.splitlines():
            if BAR_THEN_TEXT.search(raw):
                problems.append(f"code cell {i}, text after Spark's bar: {raw[-300:]}")
    return problems


# Issue 41: the notebooks run again with MLflow autologging on (Databricks turns it on by default)
# when this variable is 1 (`make test-notebooks-autolog`); one notebook always does, below.
AUTOLOG_ENV = "SPARK_ESTIMATORS_NOTEBOOK_AUTOLOG"
AUTOLOG_NOTEBOOK = "torch_quickstart.ipynb"


def autolog_cell(tracking_uri: str, source: str):
    """A first cell that turns ``mlflow.autolog()`` on, as Databricks does before a notebook.

    It imports pyspark and the notebook's frameworks first, so MLflow's own set-up lines (its
    Spark datasource autologging needs a JVM jar we do not ship) land in this cell, which the
    noise check leaves out; every later cell must stay as clean as without autologging.
    """
    frameworks = [m for m in ("torch", "pytorch_lightning", "keras") if m in source]
    frameworks += ["tensorflow"] if "keras" in frameworks else []
    return nbformat.v4.new_code_cell(
        "import os\n"
        'os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"\n'
        'os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"\n'
        "import pyspark.ml\n" + "".join(f"import {m}\n" for m in frameworks) + "import mlflow\n"
        f"mlflow.set_tracking_uri({tracking_uri!r})\n"
        # MLflow's Spark datasource autologging needs its JVM jar, which this project does not
        # ship (Databricks has it): it would warn at every session start, so it stays off.
        'mlflow.autolog(exclude_flavors=["spark"])\n'
    )


def run_notebook(path, tracking_uri: str | None = None):
    """Execute the notebook at ``path`` (first turning autologging on with a ``tracking_uri``).

    Returns the executed notebook without the autolog cell.
    """
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    # Committed notebooks carry no outputs; they are produced here.
    stale = [i for i, c in enumerate(code) if c.get("outputs") or c.get("execution_count")]
    assert not stale, f"{path.name}: code cells {stale} have stored outputs; clear them"
    assert any("assert " in c.source for c in code), f"{path.name} checks none of its results"
    if tracking_uri is not None:
        nb.cells.insert(0, autolog_cell(tracking_uri, "\n".join(c.source for c in code)))
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO)}},
    )
    try:
        client.execute(env=KERNEL_ENV)
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"{path.name} failed{' with autologging on' if tracking_uri else ''}:\n{exc}")
    if tracking_uri is not None:
        nb.cells.pop(0)
    problems = output_problems(nb, autolog=tracking_uri is not None)
    assert not problems, f"{path.name}: warnings, banners or stage bars:\n" + "\n".join(problems)
    return nb


def test_the_notebooks_directory_has_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {REPO / 'notebooks'}"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    autolog = os.environ.get(AUTOLOG_ENV, "") == "1"
    run_notebook(path, (tmp_path / "mlruns").as_uri() if autolog else None)


@pytest.mark.timeout(1800)
def test_a_notebook_runs_with_mlflow_autolog_on(tmp_path, monkeypatch):
    """The torch quickstart under ``mlflow.autolog()``: it passes, and each fit is one run."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the kernel's directory store
    uri = (tmp_path / "mlruns").as_uri()
    run_notebook(REPO / "notebooks" / AUTOLOG_NOTEBOOK, uri)
    client = mlflow.tracking.MlflowClient(uri)
    # The quickstart fits once (its Databricks cell fits only on Databricks): one run.
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    assert run.data.tags["spark_estimators.estimator"] == "TorchEstimator"
    assert run.data.params["model"] == "Sequential", run.data.params["model"]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(steps) == list(range(5)), steps  # its epochs=5: one point per epoch


FIT_CELLS = [
    """\
from spark_estimators.core.session import create_local_session
# Spark draws its console bar only when this is on (pyspark turns it on for some terminals).
spark = create_local_session(spark__ui__showConsoleProgress="true")
assert spark.sparkContext._jsc.sc().progressBar().isDefined()
""",
    """\
import tempfile
import numpy as np
import torch
from pyspark.ml.linalg import Vectors
from spark_estimators.store import Store
from spark_estimators.torch import TorchEstimator

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 2))
rows = [(Vectors.dense(r.tolist()), float(r @ [1.5, -2.0])) for r in x]
df = spark.createDataFrame(rows, ["features", "y"]).cache()
store = Store.create(tempfile.mkdtemp(prefix="nb-output-"))


def estimator(run_id):
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    return TorchEstimator(
        num_proc=2, store=store, model=net, loss=torch.nn.MSELoss(),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
        feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=3, run_id=run_id,
    )
""",
    """\
model = estimator("single").fit(df)
""",
    """\
out = model.transform(df).limit(4).collect()
assert len(out) == 4
""",
    """\
import threading
fits = [threading.Thread(target=estimator(name).fit, args=(df,)) for name in ("left", "right")]
for t in fits:
    t.start()
for t in fits:
    t.join()
""",
    """\
import time
from spark_estimators.core.progress import EpochProgress


def slow_job():
    spark.sparkContext.parallelize(range(4), 4).map(lambda v: time.sleep(1.5) or v).collect()


shown = EpochProgress(3, verbose=1, run_id="manual")
slow_job()
shown.close()
""",
    """\
slow_job()
""",
    """\
import spark_estimators


def hello(magic_number):
    import spark_estimators.collective.torch as hvd

    hvd.init()
    print(f"Hello, rank = {hvd.rank()}, magic_number = {magic_number}")
    return hvd.rank()


assert spark_estimators.run(hello, args=(42,), num_proc=2) == [0, 1]
""",
    """\
spark.stop()
""",
]


def _stream_text(cell, name):
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == name)


@pytest.mark.timeout(900)
def test_fit_output_in_a_kernel_is_one_display_without_warnings():
    """Epoch lines once, no Spark stage bar during the fit, no warnings from our code."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in FIT_CELLS])
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": "."}}
    )
    try:
        client.execute(env=KERNEL_ENV)
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"the notebook failed:\n{exc}")
    single, transform, concurrent = nb.cells[2], nb.cells[3], nb.cells[4]
    lines = _stream_text(single, "stdout").splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert all("loss=" in line and "epoch=" not in line for line in lines), lines
    fit_err = _stream_text(single, "stderr")
    # prepare_data's Spark jobs may draw Spark's bar before training; none during the epochs.
    assert "Warning" not in fit_err and "IProgress" not in fit_err, fit_err
    assert "Warning" not in _stream_text(transform, "stderr"), _stream_text(transform, "stderr")
    both = _stream_text(concurrent, "stdout").splitlines()
    for run_id in ("left", "right"):
        mine = [line for line in both if line.startswith(f"[{run_id}] epoch ")]
        assert len(mine) == 3, both
    assert "Warning" not in _stream_text(concurrent, "stderr")
    # Spark's console bar is muted while a fit's progress shows, and restored after it.
    muted, restored = nb.cells[5], nb.cells[6]
    assert "[Stage" not in _stream_text(muted, "stderr"), _stream_text(muted, "stderr")
    assert "[Stage" in _stream_text(restored, "stderr"), restored.outputs
    # run(): the ranks' lines, and no stage bar drawn over them.
    ran = nb.cells[7]
    hello = sorted(line for line in _stream_text(ran, "stdout").splitlines() if "Hello" in line)
    assert hello == [f"[{r}]Hello, rank = {r}, magic_number = 42" for r in (0, 1)], ran.outputs
    assert "[Stage" not in _stream_text(ran, "stderr"), _stream_text(ran, "stderr")
    assert not output_problems(nb, stage_bar_on=True), output_problems(nb, stage_bar_on=True)


@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    os.environ.get(AUTOLOG_ENV, "") != "1",
    reason="runs with the notebooks under autologging (make test-notebooks-autolog)",
)
def test_the_readme_quickstart_runs_in_a_kernel_with_mlflow_autolog_on(tmp_path, monkeypatch):
    """Issue 41: the README's Python blocks, as cells of one notebook, under ``mlflow.autolog()``.

    The blocks are the ones tests/docs runs (README.md, in order); the last cell checks their
    results. Only errors count here: the README starts Spark with the plain builder, whose
    start-up lines the notebooks' noise check would flag.
    """
    import sys

    mlflow = pytest.importorskip("mlflow")
    sys.path.insert(0, str(REPO / "tests" / "docs"))
    try:
        from doc_blocks import blocks
    finally:
        sys.path.remove(str(REPO / "tests" / "docs"))
    code = [b.code for b in blocks(REPO / "README.md") if b.status == "run"]
    assert len(code) >= 3, "the README's quickstart blocks moved: update this test"
    check = (
        "assert results == [(0, 42), (1, 42)], results\n"
        'assert len(fitted.getHistory()["loss"]) == 5\n'
        "assert fitted.transform(test_df).count() == test_df.count()\n"
    )
    uri = (tmp_path / "mlruns").as_uri()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        autolog_cell(uri, "\n".join(code)),
        *(nbformat.v4.new_code_cell(c) for c in code),
        nbformat.v4.new_code_cell(check),
    ]
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO)}},
    )
    try:
        client.execute(env=KERNEL_ENV)
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"README quickstart failed with autologging on:\n{exc}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    runs = mlflow.tracking.MlflowClient(uri).search_runs(
        [e.experiment_id for e in mlflow.tracking.MlflowClient(uri).search_experiments()]
    )
    assert len(runs) == 1, [r.info.run_name for r in runs]  # the one fit: one run
