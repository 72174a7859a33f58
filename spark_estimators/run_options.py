"""Horovod's launcher arguments: how ``run()``, ``run_elastic()`` and the local launcher take them.

Horovod's ``horovod.spark.run`` / ``run_elastic`` and ``horovodrun`` have arguments that mean
something else here or nothing at all. The ones with an equivalent work:

* ``nics`` (``--network-interface``): the network interfaces the ranks' collectives use; sets
  ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` in the rank processes.
* ``timeline`` (``--timeline-filename``): each rank's collective timeline, see
  :mod:`spark_estimators.collective.api.timeline` (sets ``SPARK_ESTIMATORS_TIMELINE``).
* ``min_np`` / ``max_np`` / ``np`` (``horovodrun``'s names) are aliases of ``run_elastic``'s
  ``min_num_proc`` / ``max_num_proc`` / ``num_proc``.

The others raise :class:`~spark_estimators.errors.ConfigurationError` naming what to do instead
(:data:`UNSUPPORTED`), in the driver, before any Spark job starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from spark_estimators import envvars as ev
from spark_estimators.errors import ConfigurationError

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"

#: Horovod arguments with no equivalent, and what to do instead.
UNSUPPORTED: dict[str, str] = {
    "extra_mpi_args": (
        "there is no mpirun: with backend='mpi' the Spark driver serves MPICH's PMI to the "
        "ranks. Pass MPI settings as environment variables with env= (MPICH reads MPIR_CVAR_* "
        "variables, e.g. env={'MPIR_CVAR_CH4_NETMOD': 'ofi'})"
    ),
    "executable": (
        "ranks run the executors' Python: set spark.pyspark.python (or PYSPARK_PYTHON) when "
        "you build the SparkSession"
    ),
    "hosts": (
        "Spark places the ranks: size the cluster (executors x cores), or use "
        "spark_estimators.run on a cluster instead of the local launcher"
    ),
    "hostfile": "Spark places the ranks: size the cluster instead of a host file",
    "host_discovery_script": (
        "run_elastic relies on Spark's task retries instead of host discovery (min_num_proc / "
        "max_num_proc bound the number of ranks)"
    ),
    "cache_capacity": "there is no response cache (negotiation is one small allgather)",
    "min_np": "elastic training is spark_estimators.run_elastic(fn, min_np=..., max_np=...)",
    "prefix_output_with_timestamp": (
        "run_elastic prefixes its ranks' lines with [rank] only; put a timestamp in your log "
        "format, or use spark_estimators.run(..., prefix_output_with_timestamp=True)"
    ),
    "cooldown_range": (
        "there is no host blacklist: Spark retries a failed task (spark.task.maxFailures) and "
        "excludes bad executors itself (spark.excludeOnFailure.enabled)"
    ),
    "max_np": "elastic training is spark_estimators.run_elastic(fn, min_np=..., max_np=...)",
}


def check_backend(backend: str) -> str:
    """``backend`` when it is a collective backend name, else a ConfigurationError naming them."""
    if backend not in ev.BACKEND_NAMES:
        raise ConfigurationError(f"backend={backend!r} is not one of {', '.join(ev.BACKEND_NAMES)}")
    return backend


def check_unsupported(where: str, **values: object) -> None:
    """Raise for the first argument of ``values`` that is set (not None/False/empty)."""
    for name, value in values.items():
        if value is None or value is False or value == "" or value == () or value == []:
            continue
        raise ConfigurationError(f"{where}({name}={value!r}) is not supported: {UNSUPPORTED[name]}")


def nics_env(nics: str | Sequence[str]) -> dict[str, str]:
    """The rank variables for Horovod's ``nics``: a name or a list of interface names."""
    names = [nics] if isinstance(nics, str) else list(nics)
    bad = [n for n in names if not isinstance(n, str) or not n.strip() or "," in n]
    if not names or bad:
        raise ConfigurationError(
            f"nics={nics!r} must be a network interface name or a list of them (e.g. "
            "['eth0']); see `ip link` on the executors"
        )
    value = ",".join(n.strip() for n in names)
    return {GLOO_SOCKET_IFNAME: value, NCCL_SOCKET_IFNAME: value}


def rank_env(
    env: dict[str, str] | None,
    *,
    nics: str | Sequence[str] | None = None,
    timeline: str | None = None,
) -> dict[str, str] | None:
    """``env`` plus the variables for ``nics`` and ``timeline`` (which win over ``env``)."""
    extra: dict[str, str] = {}
    if nics is not None:
        extra.update(nics_env(nics))
    if timeline is not None:
        if not isinstance(timeline, str) or not timeline.strip():
            raise ConfigurationError(f"timeline={timeline!r} must be a file path")
        extra[ev.TIMELINE] = timeline
    if not extra:
        return env
    if env is not None and not isinstance(env, dict):
        return env  # let run() report the bad env with its own message
    return {**(env or {}), **extra}


#: ``run_elastic``'s positional parameters, in order (to find ``env`` passed positionally).
_ELASTIC_POSITIONAL = (
    "fn", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "start_timeout",
    "elastic_timeout", "reset_limit", "env",
)  # fmt: skip
_ELASTIC_ALIASES = {"np": "num_proc", "min_np": "min_num_proc", "max_np": "max_num_proc"}


def elastic_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Map Horovod's names in ``run_elastic(*args, **kwargs)`` onto ours; refuse the rest."""
    kwargs = dict(kwargs)
    for alias, name in _ELASTIC_ALIASES.items():
        if alias not in kwargs:
            continue
        value = kwargs.pop(alias)
        index = _ELASTIC_POSITIONAL.index(name)
        given = args[index] if len(args) > index else kwargs.get(name)
        if given is not None and value is not None and given != value:
            raise ConfigurationError(
                f"run_elastic: {alias}={value!r} and {name}={given!r} disagree; {alias} is "
                f"Horovod's name for {name}, pass one of them"
            )
        if value is not None and len(args) <= index:
            kwargs[name] = value
    check_unsupported(
        "run_elastic",
        extra_mpi_args=kwargs.pop("extra_mpi_args", None),
        executable=kwargs.pop("executable", None),
        prefix_output_with_timestamp=kwargs.pop("prefix_output_with_timestamp", None),
        cooldown_range=kwargs.pop("cooldown_range", None),
    )
    nics, timeline = kwargs.pop("nics", None), kwargs.pop("timeline", None)
    if nics is not None or timeline is not None:
        index = _ELASTIC_POSITIONAL.index("env")
        if len(args) > index:
            args = (*args[:index], rank_env(args[index], nics=nics, timeline=timeline),
                    *args[index + 1 :])  # fmt: skip
        else:
            kwargs["env"] = rank_env(kwargs.get("env"), nics=nics, timeline=timeline)
    return args, kwargs


#: horovodrun flags with no equivalent here -> the :data:`UNSUPPORTED` entry explaining why.
_UNSUPPORTED_FLAGS = {
    ("-H", "--hosts"): "hosts",
    ("-hostfile", "--hostfile"): "hostfile",
    ("--mpi-args",): "extra_mpi_args",
    ("--min-np",): "min_np",
    ("--max-np",): "max_np",
    ("--host-discovery-script",): "host_discovery_script",
    ("--cache-capacity",): "cache_capacity",
}
_UNSUPPORTED_SWITCHES: dict[tuple[str, ...], str] = {}


class _Unsupported(argparse.Action):
    """Fails the command line naming the horovodrun flag and what to use instead."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option: str | None = None,
    ) -> None:
        parser.error(f"{option} is not supported: {UNSUPPORTED[self.dest]}")


def add_unsupported_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """Add horovodrun's flags that have no equivalent; each fails naming what to use instead."""
    for flags, key in _UNSUPPORTED_FLAGS.items():
        parser.add_argument(*flags, dest=key, action=_Unsupported, help=argparse.SUPPRESS)
    for flags, key in _UNSUPPORTED_SWITCHES.items():
        parser.add_argument(*flags, dest=key, nargs=0, action=_Unsupported, help=argparse.SUPPRESS)


#: horovodrun's tuning flags that take a value -> (type, the variable they set).
_TUNING_VALUES: dict[str, tuple[type, str]] = {
    "--autotune-log-file": (str, ev.HOROVOD_AUTOTUNE_LOG),
    "--autotune-warmup-samples": (int, ev.HOROVOD_AUTOTUNE_WARMUP_SAMPLES),
    "--autotune-steps-per-sample": (int, ev.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE),
    "--autotune-bayes-opt-max-samples": (int, ev.HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES),
    "--autotune-gaussian-process-noise": (float, ev.HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE),
}
#: horovodrun's on/off tuning flags (``--no-...`` sets 0, a constant that autotune keeps).
_TUNING_SWITCHES = {
    "autotune": ev.HOROVOD_AUTOTUNE,
    "hierarchical-allreduce": ev.HOROVOD_HIERARCHICAL_ALLREDUCE,
    "hierarchical-allgather": ev.HOROVOD_HIERARCHICAL_ALLGATHER,
}


def add_tuning_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """Add horovodrun's autotune and hierarchical flags (:func:`tuning_env` reads them)."""
    for name, variable in _TUNING_SWITCHES.items():
        dest = "tune_" + name.replace("-", "_")
        parser.add_argument(f"--{name}", dest=dest, action="store_const", const="1",
                            help=f"sets {variable}=1")  # fmt: skip
        if name != "autotune":
            parser.add_argument(f"--no-{name}", dest=dest, action="store_const", const="0",
                                help=f"sets {variable}=0 (autotune keeps it off)")  # fmt: skip
    for flag, (kind, variable) in _TUNING_VALUES.items():
        dest = "tune_" + flag[2:].replace("-", "_")
        parser.add_argument(flag, dest=dest, type=kind, help=f"sets {variable}")


def tuning_env(opts: argparse.Namespace) -> dict[str, str]:
    """The rank variables for the flags of :func:`add_tuning_launcher_flags` that were given."""
    env: dict[str, str] = {}
    for name, variable in _TUNING_SWITCHES.items():
        value = getattr(opts, "tune_" + name.replace("-", "_"), None)
        if value is not None:
            env[variable] = value
    for flag, (_, variable) in _TUNING_VALUES.items():
        value = getattr(opts, "tune_" + flag[2:].replace("-", "_"), None)
        if value is not None:
            env[variable] = str(value)
    return env


__all__ = [
    "UNSUPPORTED",
    "add_tuning_launcher_flags",
    "add_unsupported_launcher_flags",
    "check_unsupported",
    "elastic_arguments",
    "nics_env",
    "rank_env",
    "tuning_env",
]
