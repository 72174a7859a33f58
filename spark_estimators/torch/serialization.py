"""Moving torch models between the driver, the ranks and saved models, TorchScript included.

A scripted module (``torch.jit.script`` / ``torch.jit.trace``) cannot be pickled, so it travels
as ``torch.jit.save`` bytes (:class:`ScriptedModel`); its optimizer, which pickled alone would
lose its link to the parameters, travels as an :class:`OptimizerRecipe` (class, hyper-parameters
and parameter positions per group, state) and is rebuilt on the loaded module, as Horovod's
TorchEstimator rebuilt every optimizer. Plain modules keep travelling pickled (cloudpickle).

Saved :class:`~spark_estimators.torch.TorchModel` blobs of a scripted module start with
:data:`SCRIPT_MAGIC`; :func:`model_from_bytes` reads both kinds. A saved model's bytes are
unpickled only after :mod:`spark_estimators.core.persistence` verified the file's digest.

Checkpoints (TorchEstimator's ``checkpoint.pt``, Lightning's ``.ckpt``) hold only tensors and plain
containers, so they are read with :func:`load_checkpoint`: ``torch.load(weights_only=True)``
asked for explicitly (torch < 2.6, which ``pyproject`` allows, defaults to ``False``), which never
runs code named in the file; a refusal becomes a
:class:`~spark_estimators.errors.ModelIntegrityError` naming the file.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, TypeAlias, TypeGuard, cast

if TYPE_CHECKING:
    import os

    import torch

    #: Where ``torch.load`` / ``torch.jit.load`` put the tensors.
    MapLocation = str | torch.device | None

SCRIPT_MAGIC = b"SPARK_ESTIMATORS_TORCHSCRIPT\n"


def is_script_module(model: object) -> TypeGuard[torch.jit.ScriptModule]:
    """True for a ``torch.jit.ScriptModule`` (scripted or traced)."""
    import torch

    return isinstance(model, torch.jit.ScriptModule)


def script_to_bytes(model: torch.jit.ScriptModule) -> bytes:
    """A TorchScript module as bytes (``torch.jit.save``)."""
    import torch

    buf = io.BytesIO()
    torch.jit.save(model, buf)
    return buf.getvalue()


def script_from_bytes(blob: bytes, map_location: MapLocation = "cpu") -> torch.jit.ScriptModule:
    """The TorchScript module of :func:`script_to_bytes`, on ``map_location``."""
    import torch

    return torch.jit.load(io.BytesIO(blob), map_location=map_location)


@dataclass
class ScriptedModel:
    """A TorchScript module as ``torch.jit.save`` bytes (picklable)."""

    blob: bytes

    def load(self) -> torch.jit.ScriptModule:
        """The TorchScript module these bytes hold."""
        return script_from_bytes(self.blob)


@dataclass
class OptimizerRecipe:
    """How to rebuild an optimizer on a module's parameters after the module was re-loaded."""

    cls: type  # the optimizer class
    groups: list[dict[str, object]]  # each group's options plus "params": positions in parameters()
    state: dict[str, object]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> OptimizerRecipe:
        """The recipe of ``optimizer``: class, param groups (by position in ``model``), state."""
        position = {id(p): i for i, p in enumerate(model.parameters())}
        groups: list[dict[str, object]] = []
        for group in optimizer.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            options["params"] = [position[id(p)] for p in group["params"]]
            groups.append(options)
        return cls(type(optimizer), groups, optimizer.state_dict())

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """A new optimizer of the recipe over ``model``'s parameters."""
        params = list(model.parameters())
        groups = [
            {**g, "params": [params[i] for i in cast("list[int]", g["params"])]}
            for g in self.groups
        ]
        optimizer = self.cls(groups)
        optimizer.load_state_dict(self.state)
        return optimizer


#: How a model and its optimizer travel to the ranks (see :func:`pack`).
TravellingModel: TypeAlias = "torch.nn.Module | ScriptedModel"
TravellingOptimizer: TypeAlias = "torch.optim.Optimizer | OptimizerRecipe"


def pack(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[TravellingModel, TravellingOptimizer]:
    """(model, optimizer) as they travel to the ranks: scripted ones as bytes and a recipe."""
    if optimizer is not None and is_script_module(model):
        return ScriptedModel(script_to_bytes(model)), OptimizerRecipe.of(optimizer, model)
    if is_script_module(model):
        return ScriptedModel(script_to_bytes(model)), optimizer
    return model, optimizer


def unpack(
    model: TravellingModel, optimizer: TravellingOptimizer
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The inverse of :func:`pack`, on a rank."""
    if isinstance(model, ScriptedModel):
        model = model.load()
    if isinstance(optimizer, OptimizerRecipe):
        optimizer = optimizer.build(model)
    return model, optimizer


def load_checkpoint(
    source: str | os.PathLike[str] | BinaryIO, map_location: MapLocation, name: str
) -> dict[str, Any]:
    """``torch.load(source, weights_only=True)``; a refused object raises ModelIntegrityError.

    Parameters
    ----------
    source
        A path or a binary file object.
    map_location
        As for ``torch.load``.
    name
        The file's name in the store, for the error message.
    """
    import pickle

    import torch

    from spark_estimators.errors import ModelIntegrityError

    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ModelIntegrityError(
            f"refused to load checkpoint {name!r}: it holds objects other than tensors and plain "
            f"containers, which torch.load(weights_only=True) does not unpickle ({exc}). A "
            "checkpoint written by spark_estimators holds only those, so this file was altered "
            "or written by other code; delete it (or the run's checkpoint directory) to train "
            "from scratch. If your own module's hyper-parameters or optimizer state hold such "
            "objects, register their classes with torch.serialization.add_safe_globals in the "
            "module that defines them, or keep them to plain values.",
            path=name,
        ) from exc


def model_to_bytes(model: object) -> bytes:
    """A trained model as bytes: TorchScript modules through ``torch.jit.save``."""
    if is_script_module(model):
        return SCRIPT_MAGIC + script_to_bytes(model)
    from spark_estimators._base.pickling import dumps_by_value

    return dumps_by_value(model)


def model_from_bytes(blob: bytes) -> torch.nn.Module:
    """Read :func:`model_to_bytes`'s output (on the CPU)."""
    if blob.startswith(SCRIPT_MAGIC):
        return script_from_bytes(blob[len(SCRIPT_MAGIC) :])
    import cloudpickle

    return cloudpickle.loads(blob)
