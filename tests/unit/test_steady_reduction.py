"""The steady state's in-place reduction (collective/torch/steady.py) gives the engine's bits.

``reduce_rows_into`` adds the other ranks' rows straight into this rank's gradients; the
engine's inline path (``_reduce_rows``) sums a (ranks, n) array along axis 0. Both must give the
same bits on every rank, or ranks that take the steady state and ranks that fall back to the
engine would drift apart.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from spark_estimators.collective.backends.base import ReduceOp  # noqa: E402
from spark_estimators.collective.runtime.allreduce import _reduce_rows  # noqa: E402
from spark_estimators.collective.torch.steady import reduce_rows_into, row_reducer  # noqa: E402


@pytest.mark.parametrize("planned", [False, True], ids=["reduce_rows_into", "row_reducer"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize(
    ("op", "post"), [(ReduceOp.SUM, 1.0), (ReduceOp.SUM, 0.25), (ReduceOp.SUM, 1 / 3),
                     (ReduceOp.AVERAGE, 1.0), (ReduceOp.AVERAGE, 0.7)],
)  # fmt: skip
def test_in_place_reduction_equals_the_engines_bit_for_bit(
    planned: bool, dtype: str, size: int, op: ReduceOp, post: float
) -> None:
    """Both ways: the call, and the reduction planned once per wire (two ranks: two ufuncs)."""
    rng = np.random.default_rng(size)
    n = 1001
    # values whose sums round differently in another order (mixed magnitudes and signs)
    rows = (rng.standard_normal((size, n)) * 10.0 ** rng.integers(-3, 4, (size, n))).astype(dtype)
    want = _reduce_rows(rows.view(np.uint8), dtype, n, op, size, post)
    for rank in range(size):
        own = rows[rank].copy()
        peers = {r: rows[r] for r in range(size) if r != rank}
        scratch = np.empty_like(own) if size > 2 and rank > 0 else None
        if planned:
            reduce = row_reducer(own, peers, rank, scratch, op, post)
            reduce()
        else:
            reduce_rows_into(own, peers, rank, scratch, op, post)
        assert own.tobytes() == want.tobytes(), (rank, dtype, size, op, post)


def test_the_order_matters_so_the_check_above_can_fail() -> None:
    """With three ranks a sum in another order gives other bits: rank order is not optional."""
    rows = np.array([[1.0], [1e8], [-1e8]], dtype=np.float32)
    assert ((rows[0] + rows[1]) + rows[2])[0] != (rows[0] + (rows[1] + rows[2]))[0]
    own = rows[2].copy()
    reduce_rows_into(own, {0: rows[0], 1: rows[1]}, 2, np.empty_like(own), ReduceOp.SUM, 1.0)
    assert own[0] == ((rows[0] + rows[1]) + rows[2])[0]
