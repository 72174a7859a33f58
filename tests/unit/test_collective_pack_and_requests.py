"""Fusion buffers, the static keys of the per-tensor allreduce path, and requests (issue 45).

In one process: the torch and numpy :class:`ArrayOps` pack tensors of any shape into one flat
buffer and split it back into each (also from a buffer longer than the tensors, and into a
non-contiguous output); the views of a fusion buffer kept per output layout, and the bulk copy's
fallback; the inline rows reduced (into a given buffer or a new array) give the bits they gave
before; ``static_key`` tells apart what the kept allreduce statics must tell apart; a request's
lazy description and its given signature hash.
"""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators.collective.backends.base import ReduceOp
from spark_estimators.collective.runtime.allreduce import _reduce_rows
from spark_estimators.collective.runtime.arrays import NumpyOps, scale_array
from spark_estimators.collective.runtime.requests import Kind, Request, signature_hash

torch = pytest.importorskip("torch")

SHAPES = [(3,), (2, 2), (1, 2, 3), (), (0,), (5,)]


def _torch_ops():
    from spark_estimators.collective.torch.arrays import TorchOps

    return TorchOps()


def test_torch_pack_and_unpack_round_trip_every_shape():
    ops = _torch_ops()
    xs = [torch.arange(int(np.prod(s)), dtype=torch.float32).reshape(s) + 10 * i
          for i, s in enumerate(SHAPES)]  # fmt: skip
    flat = ops.pack(xs)
    assert flat.tolist() == [v for x in xs for v in x.reshape(-1).tolist()]
    outs = [torch.zeros(s) for s in SHAPES]
    ops.unpack(flat * 2, outs)
    for x, out in zip(xs, outs, strict=True):
        assert out.shape == x.shape and torch.equal(out, x * 2)
    # A buffer longer than the outputs (the reused fusion buffer): only its head is read.
    longer = torch.cat([flat, torch.full((7,), -1.0)])
    outs = [torch.zeros(s) for s in SHAPES]
    ops.unpack(longer, outs)
    assert all(torch.equal(o, x) for o, x in zip(outs, xs, strict=True))
    # One output, and a non-contiguous one: written through, the rest of its base untouched.
    base = torch.zeros(3, 2)
    ops.unpack(torch.tensor([1.0, 2.0, 3.0]), [base[:, 1]])
    assert base.tolist() == [[0.0, 1.0], [0.0, 2.0], [0.0, 3.0]]


def test_torch_pack_reuses_its_buffer_and_grows_it():
    ops = _torch_ops()
    first = ops.pack([torch.ones(4), torch.ones(4)])
    again = ops.pack([torch.full((2,), 3.0)])
    assert again.data_ptr() == first.data_ptr() and again.tolist() == [3.0, 3.0]
    grown = ops.pack([torch.ones(20)])
    assert grown.numel() == 20 and grown.tolist() == [1.0] * 20


@pytest.mark.parametrize("bulk", [True, False], ids=["foreach-copy", "copy-each"])
def test_torch_unpack_from_a_reused_buffer_keeps_views_per_layout(monkeypatch, bulk):
    from spark_estimators.collective.torch import arrays

    if not bulk:  # a torch without torch._foreach_copy_: one copy_ per tensor, same results
        monkeypatch.setattr(arrays, "_FOREACH_COPY", None)
    ops = _torch_ops()
    xs = [torch.arange(int(np.prod(s)), dtype=torch.float32).reshape(s) + 10 * i
          for i, s in enumerate(SHAPES)]  # fmt: skip
    for factor in (2.0, 5.0):  # the second round reads the kept views: the new data
        flat = ops.pack(xs)
        flat.mul_(factor)
        outs = [torch.zeros(s) for s in SHAPES]
        ops.unpack(flat, outs)
        assert all(torch.equal(o, x * factor) for o, x in zip(outs, xs, strict=True))
    kept = ops._local.kept  # the thread's views, by buffer
    fused = (flat.data_ptr(), flat.dtype)
    assert list(kept[fused]) == [tuple(torch.Size(s) for s in SHAPES)]
    # The thread's scratch buffer: another layout, a non-contiguous output among them.
    for factor in (1.0, 3.0):
        ops.scratch(xs[0], 5).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]) * factor)
        base, other = torch.zeros(3, 2), torch.zeros(2)
        ops.unpack(ops.scratch(xs[0], 5), [base[:, 1], other])
        assert base[:, 1].tolist() == [factor, 2 * factor, 3 * factor]
        assert base[:, 0].tolist() == [0.0] * 3 and other.tolist() == [4 * factor, 5 * factor]
    scratch = ops.scratch(xs[0], 5)
    assert len(kept[scratch.data_ptr(), scratch.dtype]) == 1
    # Too short a head of the buffer raises, as a split of it does.
    with pytest.raises(RuntimeError):
        ops.unpack(ops.scratch(xs[0], 4), [torch.zeros(3), torch.zeros(2)])
    # Growing a buffer drops its views (they would read the old memory).
    grown = ops.pack([torch.full((100,), 7.0)] * 2)
    assert fused not in kept and kept[grown.data_ptr(), grown.dtype] == {}
    outs = [torch.zeros(100), torch.zeros(10, 10)]
    ops.unpack(grown, outs)
    assert all(bool((o == 7.0).all()) for o in outs)
    # Not a reused buffer: nothing kept, the same copies.
    outs = [torch.zeros(2), torch.zeros(1)]
    ops.unpack(torch.tensor([1.0, 2.0, 3.0]), outs)
    assert [o.tolist() for o in outs] == [[1.0, 2.0], [3.0]]
    assert len(kept[grown.data_ptr(), grown.dtype]) == 1


def test_scratch_is_the_threads_own_and_numpy_shares_it():
    import threading

    for ops, like in ((_torch_ops(), torch.ones(3)), (NumpyOps(), np.ones(3))):
        flat = ops.scratch(like, 6)
        view = np.asarray(flat)
        view[:] = np.arange(6)
        assert np.asarray(ops.scratch(like, 6)).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        theirs = []
        thread = threading.Thread(target=lambda: theirs.append(np.asarray(ops.scratch(like, 6))))
        thread.start()
        thread.join()
        # Another thread (another process set's engine) never writes this thread's buffer,
        # nor does pack().
        assert not np.shares_memory(theirs[0], view)
        assert not np.shares_memory(np.asarray(ops.pack([like, like])), view)


def test_pack_is_the_threads_own_so_two_engines_never_mix_their_batches():
    """Process sets' engines pack fused batches in their own threads at once: one shared fusion
    buffer per dtype let one engine's batch overwrite another's before it was reduced."""
    import threading

    for ops, ones in ((_torch_ops(), torch.ones), (NumpyOps(), np.ones)):
        mine = ops.pack([ones(4), 2 * ones(4)])
        packed = np.asarray(mine).copy()
        theirs = []
        thread = threading.Thread(target=lambda: theirs.append(ops.pack([7 * ones(8)])))
        thread.start()
        thread.join()
        assert not np.shares_memory(np.asarray(theirs[0]), np.asarray(mine))
        assert np.asarray(mine).tolist() == packed.tolist() == [1.0] * 4 + [2.0] * 4
        assert np.asarray(theirs[0]).tolist() == [7.0] * 8


def _reduce_rows_before(payloads, dtype, numel, op, size, post):
    """``_reduce_rows`` as it was before the fused round's work (the bits to keep)."""
    rows = np.ascontiguousarray(payloads[:, : numel * np.dtype(dtype).itemsize]).view(dtype)
    if op is ReduceOp.MIN:
        out = rows.min(axis=0)
    elif op is ReduceOp.MAX:
        out = rows.max(axis=0)
    elif op is ReduceOp.PRODUCT:
        out = rows.prod(axis=0, dtype=rows.dtype)
    else:
        out = rows.sum(axis=0, dtype=rows.dtype)
        if op is ReduceOp.AVERAGE:
            out = (out / size).astype(rows.dtype)
    if post != 1.0:
        scale_array(out, post)
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                                ReduceOp.PRODUCT])  # fmt: skip
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int32", "bool"])
def test_reduce_rows_into_a_given_buffer_gives_the_bits_of_a_new_array(size, op, dtype):
    if dtype == "bool" and op is ReduceOp.AVERAGE:
        pytest.skip("refused before anything is sent")
    rng = np.random.default_rng(size)
    numel, width = 1000, 1000 * np.dtype(dtype).itemsize + 24  # rows wider than the batch
    if dtype == "bool":
        data = rng.random((size, numel)) < 0.3
    elif dtype.startswith("int"):
        data = rng.integers(-1000, 1000, (size, numel))
    else:
        data = rng.standard_normal((size, numel)) * (1 if dtype == "float16" else 100)
    payloads = np.zeros((size, width), np.uint8)
    payloads[:, : numel * np.dtype(dtype).itemsize] = data.astype(dtype).view(np.uint8)
    for post in (1.0, 0.37):
        if dtype == "bool" and post != 1.0:
            continue
        before = _reduce_rows_before(payloads, dtype, numel, op, size, post)
        new = _reduce_rows(payloads, dtype, numel, op, size, post)
        assert new.tobytes() == before.tobytes(), (op, dtype, size, post)
        out = np.full(numel, 9, dtype=dtype)
        given = _reduce_rows(payloads, dtype, numel, op, size, post, out=out)
        assert np.shares_memory(given, out) and given.dtype == new.dtype
        assert out.tobytes() == new.tobytes(), (op, dtype, size, post)


def test_numpy_pack_and_unpack_round_trip_every_shape():
    ops = NumpyOps()
    xs = [np.arange(int(np.prod(s)), dtype=np.float64).reshape(s) + i
          for i, s in enumerate(SHAPES)]  # fmt: skip
    flat = ops.pack(xs)
    outs = [np.zeros(s) for s in SHAPES]
    ops.unpack(flat * 3, outs)
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_array_equal(out, x * 3)


def test_static_keys_differ_where_the_kept_statics_must():
    t = _torch_ops()
    a = torch.ones(4)
    assert t.static_key(a) == t.static_key(torch.zeros(4))
    assert t.static_key(a) != t.static_key(torch.ones(5))
    assert t.static_key(a) != t.static_key(torch.ones(2, 2))
    assert t.static_key(a) != t.static_key(torch.ones(4, dtype=torch.float64))
    assert hash(t.static_key(a)) == hash(t.static_key(torch.zeros(4)))
    meta = torch.ones(4, device="meta")  # another device: never the CPU tensor's key
    assert t.static_key(a) != t.static_key(meta)
    assert t.static_key(meta) == t.static_key(torch.zeros(4, device="meta"))
    n = NumpyOps()
    x = np.ones(4, dtype=np.float32)
    assert n.static_key(x) == n.static_key(np.zeros(4, dtype=np.float32))
    assert n.static_key(x) != n.static_key(np.ones(4))
    assert n.static_key(x) != n.static_key(np.ones((4, 1), dtype=np.float32))


def test_request_description_is_lazy_and_a_given_hash_is_kept():
    signature = ("ALLREDUCE", None, "float32", "cpu", ((4,),), "SUM", 1.0, 1.0)
    lazy = Request(Kind.ALLREDUCE, "allreduce.noname.7", signature, lambda a: None,
                   detail="float32 on cpu, shape (4,), op=SUM")  # fmt: skip
    assert lazy.description == "'allreduce.noname.7' float32 on cpu, shape (4,), op=SUM"
    assert lazy.signature_hash == signature_hash(signature)
    given = Request(Kind.ALLREDUCE, "x", signature, lambda a: None, "x", signature_hash=42)
    assert given.description == "x" and given.signature_hash == 42
    unhashable = Request(Kind.BARRIER, "b", ("B", [1, 2]), lambda a: None, "b")
    assert unhashable.signature_hash == signature_hash(("B", [1, 2]))
