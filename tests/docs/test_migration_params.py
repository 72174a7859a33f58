"""docs/migration.md names every parameter of horovod.spark's public API (issue 21).

The lists are the keyword names of horovod 0.28's ``horovod.spark`` signatures. A name missing
from the page means a migrating user cannot find what happens to that argument.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migration.md"

HOROVOD_KEYWORDS = {
    "run": "fn args kwargs num_proc start_timeout use_mpi use_gloo extra_mpi_args env stdout "
    "stderr verbose nics prefix_output_with_timestamp executable",
    "run_elastic": "num_proc min_num_proc max_num_proc start_timeout elastic_timeout reset_limit "
    "env stdout stderr verbose nics prefix_output_with_timestamp min_np max_np",
    "TorchEstimator": "num_proc data_module model backend store optimizer loss loss_constructors "
    "metrics loss_weights sample_weight_col gradient_compression feature_cols continuous_cols "
    "categorical_cols input_shapes validation label_cols callbacks batch_size val_batch_size "
    "epochs verbose random_seed shuffle_buffer_size shuffle partitions_per_process run_id "
    "train_minibatch_fn train_steps_per_epoch validation_steps_per_epoch transformation_fn "
    "train_reader_num_workers val_reader_num_workers reader_pool_type label_shapes "
    "inmemory_cache_all use_gpu mp_start_method backward_passes_per_step",
    "KerasEstimator": "custom_objects checkpoint_callback backend_env "
    "tensorflow_dataset_prefetch_buffer_size",
    "LightningEstimator": "transformation_edit_fields transformation_removed_fields trainer_args "
    "num_gpus logger log_every_n_steps loader_num_epochs terminate_on_nan profiler "
    "debug_data_loader train_async_data_loader_queue_size val_async_data_loader_queue_size",
    "prepare_data": "num_processes store df label_columns feature_columns validation "
    "sample_weight_col compress_sparse partitions_per_process verbose",
    "Store": "prefix_path train_path val_path test_path runs_path save_runs storage_options "
    "checkpoint_filename host port user kerb_ticket driver extra_conf temp_dir",
}


@pytest.mark.parametrize("api", sorted(HOROVOD_KEYWORDS))
def test_migration_page_names_every_horovod_keyword(api):
    named = set(re.findall(r"`([^`]+)`", PAGE.read_text()))
    words = {w for item in named for w in re.findall(r"[A-Za-z_]+", item)}
    missing = [k for k in HOROVOD_KEYWORDS[api].split() if k not in words]
    assert not missing, f"docs/migration.md does not name horovod's {api} keywords {missing}"


def _estimator_table() -> list[list[str]]:
    """The rows of the "Estimator parameters" table, as lists of cells."""
    section = PAGE.read_text().split("## Estimator parameters", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def _documented(column: int) -> tuple[set[str], set[str]]:
    """(keywords the table says the estimator takes, keywords it says it does not)."""
    taken: set[str] = set()
    refused: set[str] = set()
    for cells in _estimator_table():
        cell = cells[column]
        if cells[0]:
            names = set(re.findall(r"`(\w+)`", cells[0]))
            (refused if cell.startswith("no") else taken).update(names)
        else:  # our additions: the names are in the cells ("same": as the Torch column)
            taken.update(re.findall(r"`(\w+)`", cells[1] if cell == "same" else cell))
    return taken, refused


@pytest.mark.parametrize(("column", "framework"), [(1, "torch"), (2, "keras"), (3, "lightning")])
def test_each_estimators_params_are_the_documented_set(column, framework):
    pytest.importorskip("torch")
    pytest.importorskip(
        {"torch": "torch", "keras": "keras", "lightning": "pytorch_lightning"}[framework]
    )
    import importlib

    from spark_estimators.core.params import to_camel, to_snake
    from spark_estimators.errors import ConfigurationError

    module = importlib.import_module(f"spark_estimators.{framework}")
    cls = getattr(
        module,
        {"torch": "TorchEstimator", "keras": "KerasEstimator"}.get(framework, "LightningEstimator"),
    )
    est = cls()
    params = {to_snake(p.name) for p in est.params}
    taken, refused = _documented(column)
    assert not taken & refused
    # Every param is in the table, and every keyword the table gives it is a param or one of
    # horovod's keywords accepted at their "not used" value.
    assert params - taken == set()
    assert taken - params <= set(cls._horovod_only)
    for name in refused:
        assert not est.hasParam(to_camel(name)), name
        with pytest.raises(ConfigurationError, match=name):
            cls(**{name: object()})
