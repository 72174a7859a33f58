"""Adasum (``op=hvd.Adasum``): adaptive summation of gradients, as Horovod describes it.

Two vectors combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is ``a + b`` for orthogonal vectors and their average for parallel ones (a zero vector
leaves the other unchanged). For ``2**k`` ranks the vectors combine pairwise in a binary tree
over the ranks: ``(0, 1)``, ``(2, 3)``, ... first, then the pairs of pairs, so the number of
ranks must be a power of two (Horovod has the same rule). Each tensor of a grouped allreduce (or
of a ``DistributedOptimizer`` bucket) gets its own coefficients, as in Horovod's fused buffers.
Dot products and norms are computed in float64 on each vector divided by its largest absolute
value, so they neither overflow nor underflow: the result is right for any magnitude float64
holds. (Horovod's own sums give the plain sum when a squared norm is below sqrt(DBL_MIN) ~
1.5e-154, elements near 1e-77 and smaller, and NaN when it overflows, elements near 1e154 and
larger; see :func:`combine`.)

How it runs here: one allgather of every rank's (pre-scaled) data, then the same tree on every
rank, in rank order, so every rank gets a bitwise identical result. That moves ``size`` times
the data of a ring allreduce: fine for CPU training on a few ranks, not Horovod's
bandwidth-optimal recursive halving on large GPU jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from spark_estimators.collective.backends.base import Buffer
from spark_estimators.collective.runtime.arrays import ArrayOps, write_result
from spark_estimators.collective.runtime.engine import Engine
from spark_estimators.collective.runtime.requests import Agreement, Kind, Request
from spark_estimators.errors import ConfigurationError

#: Real floating dtypes Adasum accepts.
ADASUM_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two vectors (float64), exact at any magnitude a float64 can hold.

    Each vector is first divided by its largest absolute value, so the dot product and the
    squared norms are computed on numbers in [-1, 1] and neither overflow (|a|^2 of a vector of
    1e160s) nor underflow (|a|^2 of 1e-160s, which would make the coefficients 1 and give the sum
    of parallel vectors). With ``a = sa * u`` and ``b = sb * v``::

        (1 - a.b / 2|a|^2) a = a - (u.v / 2|u|^2) sb u
        (1 - a.b / 2|b|^2) b = b - (u.v / 2|v|^2) sa v

    where every factor stays within the range of its inputs. A zero vector contributes nothing and
    leaves the other unchanged (Horovod's coefficient 1 for a zero norm).
    """
    sa = float(np.max(np.abs(a))) if a.size else 0.0
    sb = float(np.max(np.abs(b))) if b.size else 0.0
    if sa == 0.0 or sb == 0.0 or not (np.isfinite(sa) and np.isfinite(sb)):
        # One vector is zero (its dot with the other is 0: both coefficients are 1), or the data
        # already holds inf/NaN, which propagates as it would in a plain sum.
        return np.asarray(a + b)
    u, v = a / sa, b / sb
    dot = float(np.dot(u, v))
    unormsq, vnormsq = float(np.dot(u, u)), float(np.dot(v, v))  # both >= 1 (max element is 1)
    acoeff, bcoeff = 0.5 * dot / unormsq, 0.5 * dot / vnormsq
    # Subtract before adding: a + b alone could overflow for two vectors near float64's maximum.
    return np.asarray(((a - (acoeff * sb) * u) + b) - (bcoeff * sa) * v)


def tree_reduce(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Combine ``2**k`` vectors pairwise in rank order: ``((v0, v1), (v2, v3)), ...``."""
    level = [np.asarray(v, dtype=np.float64).reshape(-1) for v in vectors]
    if not level or len(level) & (len(level) - 1):
        raise ConfigurationError(f"Adasum needs a power-of-two number of vectors, got {len(level)}")
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def reduce_segments(rows: np.ndarray, numels: Sequence[int]) -> np.ndarray:
    """Adasum of ``rows`` (one per rank), tensor by tensor (``numels`` split each row)."""
    out = np.empty(rows.shape[1], dtype=np.float64)
    offset = 0
    for n in numels:
        out[offset : offset + n] = tree_reduce(list(rows[:, offset : offset + n]))
        offset += n
    return out


def _as_float64(flat: Buffer) -> np.ndarray:
    if isinstance(flat, np.ndarray):
        return flat.astype(np.float64).reshape(-1)
    import torch

    return flat.detach().to("cpu", torch.float64).reshape(-1).numpy()


def submit(
    engine: Engine,
    ops: ArrayOps,
    inputs: Sequence[Buffer],
    outputs: Sequence[Buffer],
    display: str,
    name: str | None,
    shapes: tuple[tuple[int, ...], ...],
    prescale: float,
    postscale: float,
    blocking: bool,
) -> Future[Sequence[Buffer]]:
    """Queue an Adasum allreduce of ``inputs`` into ``outputs`` on ``engine``."""
    backend = engine.backend
    size = backend.size
    dtype, device = ops.dtype(inputs[0]), ops.device(inputs[0])
    if size & (size - 1):
        raise ConfigurationError(
            f"op=Adasum on {display!r} needs a power-of-two number of ranks (as in Horovod), got "
            f"{size}; run on 1, 2, 4, 8 ... ranks (or a process set of that size) or use "
            "op=Average"
        )
    if dtype not in ADASUM_DTYPES:
        raise ConfigurationError(
            f"op=Adasum on {display!r} needs a floating dtype, got {dtype}; use op=Sum"
        )
    numels = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    total = sum(numels)
    signature = (Kind.ALLREDUCE.name, name, dtype, device, shapes, "ADASUM", prescale, postscale)
    described = shapes[0] if len(shapes) == 1 else f"{len(shapes)} tensors {list(shapes)}"
    description = f"{display!r} {dtype} on {device}, shape {described}, op=ADASUM"

    def execute(agreement: Agreement) -> Sequence[Buffer]:
        if agreement.joined:
            raise ConfigurationError(
                f"op=Adasum on {display!r}: rank(s) {agreement.joined} already called join(); "
                "Adasum needs data from every rank"
            )
        if total == 0:
            return outputs
        one = len(inputs) == 1 and ops.is_contiguous(inputs[0])
        flat = ops.flat_view(inputs[0]) if one else ops.pack(inputs)
        local = _as_float64(flat)
        if prescale != 1.0:
            local = local * prescale
        rows = np.asarray(backend.allgather(local.reshape(1, -1).copy(), [1] * size))
        result = reduce_segments(rows.reshape(size, total), numels)
        if postscale != 1.0:
            result *= postscale
        return write_result(ops, result, inputs, outputs)

    # numel=0: a rank that called join() must not contribute zeros to a backend allreduce
    # (this op allgathers); the active ranks raise instead, see execute().
    request = Request(
        Kind.ALLREDUCE, display, signature, execute, description, numel=0, dtype=dtype,
        device=device,
    )  # fmt: skip
    return engine.submit(request, blocking=blocking)
