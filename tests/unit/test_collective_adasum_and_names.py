"""Issue 25, items 2 and 4 without processes: Adasum's pairwise step and the torch API's names."""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators.collective.runtime.adasum import combine, tree_reduce

# Every name ``horovod/torch/__init__.py`` (horovod 2626dc87) imports for its users.
HOROVOD_TORCH_NAMES = """
elastic Compression allgather_object broadcast_object broadcast_optimizer_state
broadcast_parameters allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce
grouped_allreduce_async grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async
allgather allgather_async grouped_allgather grouped_allgather_async broadcast broadcast_async
broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async
grouped_reducescatter grouped_reducescatter_async join barrier poll synchronize init shutdown
is_initialized start_timeline stop_timeline size local_size cross_size rank local_rank
cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built
ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set add_process_set
remove_process_set Average Sum Adasum Min Max Product HorovodInternalError
DistributedOptimizer SyncBatchNorm
""".split()


def _reference_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = a @ b
    return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b


@pytest.mark.parametrize("scale", [1e-300, 1e-160, 1e-77, 1e77, 1e160, 1e300])
def test_adasum_of_parallel_vectors_is_their_average_at_any_magnitude(scale):
    v = np.random.default_rng(0).standard_normal(1024)
    got = combine(v * scale, 3 * v * scale)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got / scale, 2 * v, rtol=1e-12)


@pytest.mark.parametrize("scale", [1e-160, 1.0, 1e160])
def test_adasum_of_orthogonal_vectors_is_their_sum_at_any_magnitude(scale):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(64), rng.standard_normal(64)
    b -= (a @ b) / (a @ a) * a
    np.testing.assert_allclose(combine(a * scale, b * scale) / scale, a + b, rtol=1e-12, atol=1e-12)


def test_adasum_matches_the_plain_formula_at_ordinary_magnitudes():
    rng = np.random.default_rng(2)
    vectors = [rng.standard_normal(50) for _ in range(4)]
    expected = _reference_pair(
        _reference_pair(vectors[0], vectors[1]), _reference_pair(vectors[2], vectors[3])
    )
    np.testing.assert_allclose(tree_reduce(vectors), expected, rtol=1e-12)


def test_adasum_with_a_zero_vector_returns_the_other():
    v = np.arange(1.0, 5.0)
    np.testing.assert_array_equal(combine(np.zeros(4), v), v)
    np.testing.assert_array_equal(combine(v, np.zeros(4)), v)
    np.testing.assert_array_equal(combine(np.zeros(4), np.zeros(4)), np.zeros(4))


def test_adasum_of_vectors_of_very_different_magnitudes_is_finite():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(16) * 1e-150, rng.standard_normal(16) * 1e150
    got = combine(a, b)
    assert np.all(np.isfinite(got))
    # |b| >> |a|: b's coefficient is 1 - a.b / 2|b|^2 ~ 1, and a's term adds -(a.b/2|a|^2) a,
    # which is of b's magnitude along a's direction
    expected = b - (a @ b) / (2 * (a @ a)) * a
    np.testing.assert_allclose(got, expected, rtol=1e-9)


def test_torch_adapter_has_every_name_horovod_torch_exports():
    import spark_estimators.collective.torch as hvd

    missing = [n for n in HOROVOD_TORCH_NAMES if not hasattr(hvd, n)]
    assert missing == []
    assert set(HOROVOD_TORCH_NAMES) - {"elastic"} <= set(hvd.__all__) | {"elastic"}


def test_build_queries_have_horovods_types_and_meaning():
    import torch
    import torch.distributed as dist

    import spark_estimators.collective.torch as hvd

    assert hvd.ccl_built() is False
    assert hvd.ddl_built() is False
    assert hvd.cuda_built() is (torch.version.cuda is not None)
    assert hvd.rocm_built() is (getattr(torch.version, "hip", None) is not None)
    code = hvd.nccl_built()
    assert isinstance(code, int) and not isinstance(code, bool)
    assert bool(code) == dist.is_nccl_available()
    if code:  # horovod's tests skip alltoall below NCCL 2.7 with `nccl_built() < 2700`
        major, minor, patch = torch.cuda.nccl.version()[:3]
        assert code >= 2700 or (major, minor) < (2, 7)


def test_horovod_internal_error_is_the_collective_error():
    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    assert hvd.HorovodInternalError is CollectiveError
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_grouped_ops_refuse_a_single_tensor_with_a_clear_error():
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="list of tensors"):
        hvd.grouped_allgather_async(torch.ones(2))


def test_sparse_allreduce_async_refuses_a_dense_tensor():
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(2), name="dense")


def test_horovods_mpi_ops_import_path_has_every_name():
    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.torch import mpi_ops

    assert mpi_ops.synchronize is hvd.synchronize  # horovod's test_adasum_pytorch imports it so
    assert set(HOROVOD_TORCH_NAMES) - {"elastic"} <= set(mpi_ops.__all__) | {"elastic"}
