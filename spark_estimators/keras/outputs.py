"""A Keras model's outputs on the driver: named (dict) outputs and vector labels.

Named outputs: a functional model built with ``outputs={"a": ..., "b": ...}`` (or with a list of
named layers) predicts a dict; Keras orders its outputs as ``model.output_names`` (a dict's keys
sorted, ``keras.tree.flatten``'s order), and a tuple of labels is matched to them in that order.
So ``label_cols[i]`` is the label of ``model.output_names[i]`` and ``transform`` writes that
output to ``outputCols[i]`` (``<label_cols[i]>__output`` by default). ``loss``, ``loss_weights``
and ``metrics`` may be dicts keyed by output name, as for ``model.compile``; their keys are
checked in the driver (:func:`check_named_outputs`) so a misspelt name fails before any job.

Vector labels: as horovod's KerasModel did (it wrote a ``DenseVector`` for a vector label), the
output of a label that was an ML vector column is written as a ``VectorUDT`` column (dense,
also for a sparse label: predictions are dense); other outputs stay doubles or arrays.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import keras
    from pyspark.sql import Column, DataFrame

    from spark_estimators.data.metadata import ColumnInfo

#: Column kinds (spark_estimators.data.metadata) that come from an ML vector column.
VECTOR_KINDS = ("vector", "sparse_vector", "vector_udt")


def output_names(model: keras.Model) -> list[str] | None:
    """``model.output_names`` of a built functional or Sequential model, else None."""
    try:
        outputs = model.outputs
        names = model.output_names
    except (AttributeError, ValueError):  # a subclassed or unbuilt model
        return None
    return [str(n) for n in names] if outputs and names else None


def check_named_outputs(
    model: keras.Model,
    label_cols: Sequence[str],
    named: Mapping[str, object],
) -> None:
    """Check the label count and the keys of dict-valued ``loss``/``loss_weights``/``metrics``.

    ``named`` maps the keyword (``"loss"``, ...) to its value; values that are not dicts are
    not checked here. A model whose outputs are unknown (subclassed) is left to Keras.
    """
    names = output_names(model)
    if names is None:
        return
    if len(names) > 1 and len(names) != len(label_cols):
        raise ConfigurationError(
            f"the Keras model has {len(names)} outputs {names!r} but label_cols names "
            f"{len(label_cols)} column(s) {list(label_cols)!r}: give one label column per output, "
            "in the order of model.output_names"
        )
    for keyword, value in named.items():
        if not isinstance(value, Mapping):
            continue
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ConfigurationError(
                f"{keyword} has key(s) {unknown!r} that are not outputs of the model: its "
                f"outputs are {names!r} (model.output_names); key {keyword} by those names"
            )


def check_output_widths(
    model: keras.Model,
    label_cols: Sequence[str],
    loss: object,
    columns: Mapping[str, ColumnInfo],
    same_width_losses: Collection[str],
) -> None:
    """Several outputs: compare each output's width with its label's where its loss needs both.

    Catches ``label_cols`` written in a dict's own order rather than Keras's sorted one, which
    would otherwise train each output on the other's label (``mse`` broadcasts a 1-wide label).
    """
    outputs = list(getattr(model, "outputs", None) or [])
    names = output_names(model)
    if len(outputs) < 2 or names is None or not len(names) == len(outputs) == len(label_cols):
        return
    for i, (tensor, label, name) in enumerate(zip(outputs, label_cols, names, strict=True)):
        if isinstance(loss, Mapping):
            loss_i = loss.get(name)
        elif isinstance(loss, list | tuple):
            loss_i = loss[i] if len(loss) == len(outputs) else loss[0]
        else:
            loss_i = loss
        loss_name = loss_i if isinstance(loss_i, str) else getattr(loss_i, "name", None)
        loss_name = str(loss_name or getattr(loss_i, "__name__", ""))
        dims = list(tensor.shape[1:])
        info = columns.get(label)
        if loss_name.lower() not in same_width_losses or info is None or None in dims:
            continue
        width, label_width = math.prod(dims), math.prod(info.shape)
        if width != label_width:
            raise ConfigurationError(
                f"output {name!r} (model.output_names[{i}]) gives {width} value(s) per row but "
                f"its label column {label!r} (label_cols[{i}]) holds {label_width}, and loss "
                f"{loss_name!r} needs both the same width: label_cols[i] is the label of "
                f"model.output_names[i] = {names!r} (a dict of outputs is ordered by its sorted "
                "keys); reorder label_cols"
            )


def vector_outputs(label_cols: Sequence[str], columns: Mapping[str, ColumnInfo]) -> list[bool]:
    """For each label (so each output), whether it was an ML vector column."""
    return [getattr(columns.get(label), "kind", None) in VECTOR_KINDS for label in label_cols]


def as_vector(column: Column, row_shape: Sequence[int]) -> Column:
    """An output column (double, array or nested arrays) as a dense ``VectorUDT`` column."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    if not row_shape:
        column = F.array(column)
    for _ in range(len(row_shape) - 1):
        column = F.flatten(column)
    return array_to_vector(column)


def with_vector_outputs(
    scored: DataFrame,
    output_cols: Sequence[str],
    output_shapes: Sequence[Sequence[int]],
    vectors: Sequence[bool],
) -> DataFrame:
    """``scored`` with the outputs flagged in ``vectors`` turned into ``VectorUDT`` columns."""
    from pyspark.sql import functions as F

    flagged = {
        name: shape
        for name, shape, vector in zip(output_cols, output_shapes, vectors, strict=False)
        if vector
    }
    if not flagged:
        return scored
    return scored.select(
        *[
            as_vector(F.col(f"`{c}`"), flagged[c]).alias(c) if c in flagged else F.col(f"`{c}`")
            for c in scored.columns
        ]
    )
