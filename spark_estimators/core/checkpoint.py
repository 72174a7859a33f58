"""The run's ``checkpoint.json``: one schema read and written by every framework.

Rank 0 writes the info file after each epoch, *after* the framework's own checkpoint file
(``checkpoint.pt``, ``checkpoint.keras`` or Lightning's ``last_epoch.ckpt``), so an info file
always names a complete checkpoint. The driver reads it for a hot start (a refit with the same
``run_id``): the next epoch, the history so far, and the number of ranks the saved learning rate
was scaled for.

Schema (JSON object)::

    {"schema": 1, "framework": "torch", "epoch": 3, "num_proc": 2,
     "history": [{"epoch": 0, "loss": ...}, ...], "fingerprint": "<sha256>", "extra": {...}}

Files written before this schema are still read: torch's ``{"epoch", "history"}``, keras's
``{"epoch", "size", "history"}`` and lightning's ``{"epoch", "history", "checkpoint",
"framework"}`` (unknown keys land in ``extra``; ``size`` is ``num_proc``).

Also here: the weight fingerprints every framework's ranks compare. How a rank writes the info
after each epoch is :func:`spark_estimators.core.rank.commit_epoch`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from spark_estimators.errors import ConfigurationError
from spark_estimators.store.layout import join_path

if TYPE_CHECKING:
    import keras
    import torch

    from spark_estimators.store.base import StoreBase

INFO_FILE = "checkpoint.json"
SCHEMA_VERSION = 1
FRAMEWORKS = ("torch", "keras", "lightning")
# Before the framework tag, torch and keras wrote untagged files (lightning always tagged its).
_UNTAGGED_OK = ("torch", "keras")
_KEYS = ("schema", "framework", "epoch", "num_proc", "history", "fingerprint", "extra")


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``checkpoint.json`` says about a run's last finished epoch.

    Parameters
    ----------
    framework : str or None
        ``"torch"``, ``"keras"`` or ``"lightning"``; None for an untagged file of an older
        version (torch or keras).
    epoch : int
        The last finished (and checkpointed) epoch, 0-based.
    num_proc : int or None
        Ranks of the run that wrote it (the saved learning rate is scaled for them); None when
        the file does not say.
    history : tuple of dict
        One dict of metrics per finished epoch, each with its ``"epoch"``.
    fingerprint : str or None
        SHA-256 of rank 0's weights at that epoch.
    extra : Mapping
        Framework-specific fields (lightning: ``"checkpoint"``, the file to resume from).
    """

    framework: str | None
    epoch: int
    num_proc: int | None = None
    history: tuple[dict[str, float], ...] = ()
    fingerprint: str | None = None
    extra: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> str:
        """The info as the JSON text of ``checkpoint.json``."""
        return json.dumps(
            {
                "schema": SCHEMA_VERSION,
                "framework": self.framework,
                "epoch": int(self.epoch),
                "num_proc": self.num_proc,
                "history": list(self.history),
                "fingerprint": self.fingerprint,
                "extra": dict(self.extra),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> CheckpointInfo:
        """Parse ``checkpoint.json`` (this schema or an older one); ValueError when malformed."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("epoch"), int):
            raise ValueError("checkpoint info must be a JSON object with an integer 'epoch'")
        history = data.get("history", [])
        if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
            raise ValueError("checkpoint info 'history' must be a list of objects")
        num_proc = data.get("num_proc", data.get("size"))  # keras wrote "size"
        extra = dict(data.get("extra") or {})
        # Older files kept framework fields at the top level (lightning's "checkpoint").
        extra.update({k: v for k, v in data.items() if k not in _KEYS and k != "size"})
        return cls(
            framework=data.get("framework"),
            epoch=int(data["epoch"]),
            num_proc=None if num_proc is None else int(num_proc),
            history=tuple(history),
            fingerprint=data.get("fingerprint"),
            extra=extra,
        )


def store_path(store: StoreBase, run_id: str, name: str = "") -> str:
    """The path of ``name`` in the run's checkpoint directory of ``store``.

    The one place a checkpoint path is built (``checkpoint.json``, each framework's weights file,
    Lightning's ``.ckpt`` files); with no ``name``, the directory itself (no trailing ``/``).
    """
    return join_path(store.get_checkpoint_path(run_id), name)


def info_path(store: StoreBase, run_id: str) -> str:
    """Where the run's ``checkpoint.json`` lives in ``store``."""
    return store_path(store, run_id, INFO_FILE)


def read_info(store: StoreBase, run_id: str, framework: str | None = None) -> CheckpointInfo | None:
    """The run's checkpoint info, or None when it has none yet.

    Parameters
    ----------
    store : Store
        The run's store (driver or rank side).
    run_id : str
        The run.
    framework : str, optional
        The estimator's framework: a file of another framework raises ConfigurationError
        (its checkpoint cannot be resumed).

    Raises
    ------
    ConfigurationError
        The file is not a checkpoint info, or belongs to another framework.
    """
    path = info_path(store, run_id)
    if not store.exists(path):
        return None
    try:
        info = CheckpointInfo.from_json(store.read_text(path))
    except ValueError as exc:
        raise ConfigurationError(
            f"{path} is not a checkpoint info ({exc}); use a new run_id or delete the run with "
            f"store.delete_run({run_id!r})"
        ) from exc
    legacy = info.framework is None and framework in _UNTAGGED_OK
    if framework is not None and info.framework != framework and not legacy:
        raise ConfigurationError(
            f"run_id={run_id!r} holds checkpoints of another estimator "
            f"({info.framework or 'untagged'}, not {framework}); use a new run_id or delete "
            f"the run with store.delete_run({run_id!r})"
        )
    return info


def write_info(store: StoreBase, run_id: str, info: CheckpointInfo) -> None:
    """Write ``info`` atomically; call it after the framework's checkpoint file is complete."""
    store.write_bytes_atomic(info_path(store, run_id), info.to_json().encode("utf-8"))


class StartFields(TypedDict):
    """Where a (hot) start begins: the train spec's ``start_epoch`` and ``history``."""

    start_epoch: int
    history: list[dict[str, float]]


def start_fields(info: CheckpointInfo | None) -> StartFields:
    """The train spec's ``start_epoch`` and ``history`` for a (hot) start from ``info``."""
    if info is None:
        return {"start_epoch": 0, "history": []}
    return {"start_epoch": info.epoch + 1, "history": list(info.history)}


# -- the weights fingerprint every framework's ranks compare --------------------------------------
# What the ranks must agree on is what data-parallel training keeps equal: the parameters (the
# same start by broadcast, the same averaged gradients, the same optimizer). Buffers and Keras's
# non-trainable weights are left out: BatchNorm's running mean and variance are updated from each
# rank's own batches and legitimately differ (horovod returns rank 0's, as we do; see the
# estimators' ``average_running_stats``).
def fingerprint(chunks: Iterable[bytes]) -> str:
    """SHA-256 over ``chunks`` in order (ranks compare it: they must end with the same weights)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def torch_fingerprint(model: torch.nn.Module) -> str:
    """Fingerprint of a torch module's parameters (names and values, sorted by name).

    Buffers (BatchNorm running statistics, ``num_batches_tracked``) are not included.
    """

    def chunks() -> Iterable[bytes]:
        for name, tensor in sorted(model.named_parameters(), key=lambda item: item[0]):
            yield name.encode()
            yield tensor.detach().cpu().contiguous().numpy().tobytes()

    return fingerprint(chunks())


def keras_fingerprint(model: keras.Model) -> str:
    """Fingerprint of a Keras model's trainable weights, in ``model.trainable_weights`` order.

    Non-trainable weights (BatchNormalization's moving mean and variance) are not included.
    """
    import numpy as np

    return fingerprint(np.ascontiguousarray(w.numpy()).tobytes() for w in model.trainable_weights)
