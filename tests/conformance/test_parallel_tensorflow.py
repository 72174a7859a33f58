"""horovod's ``horovodrun -np 2`` TensorFlow and Keras test files under our launcher.

See test_parallel.py for how they run.

``parallel/test_tensorflow.py`` runs every test twice, in a TF1 graph and eagerly (horovod's
``run_all_in_graph_and_eager_modes``), as subtests; a failed subtest fails the test. The whole
file takes minutes on 2 cores, the process-set file two (``slow``, under Gloo and under MPI);
CI runs a ``-k`` subset of each.

The Keras files (issue 44) run whole in CI: ``test_tensorflow2_keras.py`` with
``test_tensorflow_keras.py`` and ``test_keras.py`` in one launcher run (the last two are horovod's
TensorFlow 1 tests, which skip themselves on TensorFlow 2), and
``test_tensorflow2_keras_process_sets.py`` in its own (its class initialises with process sets).
"""

from __future__ import annotations

from collections import Counter

import pytest
from test_parallel import HERE, _launch

TF_TESTS = 143  # horovod's test_tensorflow.py (class TensorFlowTests)
TF_PROCESS_SET_TESTS = 29  # horovod's test_tensorflow_process_sets.py

#: The CI subsets (the whole files are ``slow``): allreduce (dense, fused, scaled, sparse,
#: gradients), alltoall, compression, objects, elastic state, the gradient tapes, model parallel.
CI_SUBSET = (
    "horovod_allreduce_cpu or allreduce_grad_cpu or allreduce_indexed_slices_cpu or "
    "horovod_alltoall_cpu or compression_fp16 or broadcast_object or elastic_state or "
    "gradient_tape or model_parallel"
)
CI_PROCESS_SET_SUBSET = (
    "allreduce_cpu_process_sets or distributed_gradient_tape or broadcast_variables_process_sets"
)


def _counted(reports: dict, cls: str) -> int:
    return sum(1 for test in reports[0]["outcomes"] if f"::{cls}::test_" in test
               and not test.endswith("::test_session"))  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_horovod_test_tensorflow_under_two_ranks(tmp_path):
    reports = _launch(tmp_path, "test_tensorflow.py", "gloo", 1400)
    assert _counted(reports, "TensorFlowTests") == TF_TESTS


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_horovod_test_tensorflow_subset_under_two_ranks(tmp_path):
    reports = _launch(tmp_path, "test_tensorflow.py", "gloo", 500, "-k", CI_SUBSET)
    assert _counted(reports, "TensorFlowTests") >= 10


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_horovod_test_tensorflow_process_sets_under_two_ranks(tmp_path, backend):
    reports = _launch(tmp_path, "test_tensorflow_process_sets.py", backend, 500)
    assert _counted(reports, "TensorFlowProcessSetsTests") == TF_PROCESS_SET_TESTS


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_horovod_test_tensorflow_process_sets_subset_under_two_ranks(tmp_path):
    reports = _launch(
        tmp_path, "test_tensorflow_process_sets.py", "gloo", 500, "-k", CI_PROCESS_SET_SUBSET
    )
    assert _counted(reports, "TensorFlowProcessSetsTests") == 4


#: horovod's Keras test files: the outcome of each of their tests on both ranks, by class
#: (docs/conformance.md has them one by one). Tf2KerasTests: 7 strict xfails are documented
#: differences (backward_passes_per_step > 1, Keras 2's ``_compute_gradients``), one skip is
#: horovod's (no Keras legacy optimizers). TfKerasTests, KerasTests: TensorFlow 1 only.
KERAS_OUTCOMES = {
    "Tf2KerasTests": {"passed": 5, "skipped": 1, "xfailed": 7},
    "TfKerasTests": {"skipped": 10},
    "KerasTests": {"skipped": 7},
}


def _outcomes(reports: dict, cls: str) -> dict:
    mine = {t: o for t, o in reports[0]["outcomes"].items() if f"::{cls}::test_" in t}
    return dict(Counter(o for t, o in mine.items() if not t.endswith("::test_session")))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_horovod_keras_test_files_under_two_ranks(tmp_path):
    others = [str(HERE / "parallel" / f) for f in ("test_tensorflow_keras.py", "test_keras.py")]
    reports = _launch(tmp_path, "test_tensorflow2_keras.py", "gloo", 500, *others)
    assert {cls: _outcomes(reports, cls) for cls in KERAS_OUTCOMES} == KERAS_OUTCOMES


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_horovod_keras_process_sets_under_two_ranks(tmp_path):
    reports = _launch(tmp_path, "test_tensorflow2_keras_process_sets.py", "gloo", 500)
    assert _outcomes(reports, "Tf2KerasProcessSetsTests") == {"passed": 1}
