r"""Driver-side progress of a fit: one display per fit, and one line per epoch.

Epoch numbers (one convention everywhere, as Keras): the data counts from 0, what a person reads
counts from 1. A history entry's ``epoch`` (``model.getHistory()``), the ``epoch`` callbacks
receive, MLflow's ``step`` and checkpoints' start epoch are the 0-based index, like Keras'
``History`` and horovod's estimators; every line, bar and plot says ``epoch 1/5`` for the entry
with ``epoch`` 0, like Keras' progress output (:func:`epoch_label`, :func:`history_lines`).

What a fit shows (``verbose >= 1``):

- In a terminal: a tqdm bar of epochs on stderr, with each epoch's metrics printed above it once.
- In a Jupyter notebook: an ipywidgets bar (``tqdm.notebook``) when ipywidgets is installed
  (the ``[notebook]`` extra); otherwise only the epoch lines, after one line saying how to get
  the widget (a text bar would be redrawn as separate output blocks between the lines, and
  tqdm would warn "IProgress not found"). :func:`plot_history` plots a history (matplotlib,
  also in the extra) or prints it as a text chart.
- Several fits at once (threads): once fits overlap, each one's lines start with ``[run_id]``
  and a bar started then is named by its run id; in a terminal only the first fit draws a text
  bar, as two bars redrawing with ``\\r`` garble each other.

Spark's own console progress bar (``spark.ui.showConsoleProgress``, drawn by the JVM on stderr)
would overwrite ours. Spark reads that setting only at start-up, and its ``ConsoleProgressBar``
has no switch, so while a fit shows progress the bar's console stream is swapped for a null one
through the JVM (reflection on ``ConsoleProgressBar.console``) and restored when the last
displaying fit ends. Where that is not possible (Spark Connect, another Spark build), the fit
draws no bar of its own, only the epoch lines, so nothing overwrites anything.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from spark_estimators._base.console_bar import SPARK_CONSOLE_BAR

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_active: list[EpochProgress] = []  # fits displaying progress now, oldest first


def epoch_label(epoch: int, epochs: int) -> str:
    """How a person reads an epoch: ``epoch 1/5`` for the history entry with ``epoch`` 0."""
    return f"epoch {int(epoch) + 1}/{epochs}"


def history_lines(history: Sequence[Mapping[str, float]], epochs: int | None = None) -> list[str]:
    """The lines a fit printed live, from its history (``model.getHistory()``).

    ``epochs`` defaults to the number of entries (a fit that ran to its end).

    >>> history_lines([{"epoch": 0, "loss": 0.5}, {"epoch": 1, "loss": 0.25}])
    ['epoch 1/2: loss=0.5', 'epoch 2/2: loss=0.25']
    """
    total = epochs if epochs is not None else len(history)
    return [f"{epoch_label(cast(int, h['epoch']), total)}: {format_metrics(h)}" for h in history]


def format_metrics(logs: Mapping[str, object]) -> str:
    """``key=value`` for each metric (the epoch number is not repeated).

    ``loss`` is left out when another training metric shows the same value (a LightningModule
    that logs its loss as ``train_loss``): each value is shown once, under the user's name.

    >>> format_metrics({"epoch": 0, "loss": 0.5, "train_loss": 0.5, "val_loss": 0.25})
    'train_loss=0.5 val_loss=0.25'
    """
    parts = []
    shown = {k: _shown(v) for k, v in logs.items() if k != "epoch"}
    loss = shown.get("loss")
    twin = loss is not None and any(
        v == loss for k, v in shown.items() if k != "loss" and not k.startswith("val")
    )
    for key, value in logs.items():
        if key == "epoch" or isinstance(value, bool) or (key == "loss" and twin):
            continue
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif isinstance(value, int):
            parts.append(f"{key}={value}")
    return " ".join(parts)


def _shown(value: object) -> str | None:
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:.4g}"
    return None


def in_notebook() -> bool:
    """True inside a Jupyter kernel (ipykernel's ZMQ shell)."""
    shell_mod = sys.modules.get("IPython")
    if shell_mod is None:
        return False
    try:
        shell = shell_mod.get_ipython()
    except AttributeError:  # pragma: no cover - partial IPython
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _has_widgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


NOTEBOOK_HINT = (
    "(epoch lines only: pip install 'spark-estimators[notebook]' for a progress bar widget "
    "and plot_history plots)"
)
_hinted = False


def _hint_once() -> None:
    """Say once per process how to get the widget, where a notebook has no ipywidgets."""
    global _hinted
    if not _hinted:
        _hinted = True
        print(NOTEBOOK_HINT, flush=True)


def plot_history(
    history: Sequence[Mapping[str, float]],
    keys: tuple[str, ...] = ("loss", "val_loss"),
    title: str = "loss per epoch",
) -> None:
    """Plot metrics per epoch (``model.getHistory()``); a text chart without matplotlib.

    The x axis counts epochs from 1, as the epoch lines do; the y axis is logarithmic when every
    value is positive. Keys a history lacks are skipped. Shows the figure (``plt.show()``) and
    returns None; without matplotlib it prints the text chart, which says how to get the plot
    (``pip install 'spark-estimators[notebook]'``).
    """
    keys = tuple(k for k in keys if any(k in h for h in history))
    numbers = [int(h["epoch"]) + 1 for h in history]
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        top = max((abs(float(h[k])) for h in history for k in keys if k in h), default=1.0)
        print(f"{title} (text chart: pip install 'spark-estimators[notebook]' for a plot)")
        for n, h in zip(numbers, history, strict=True):
            for k in keys:
                if k in h:
                    bar = "#" * round(40 * abs(float(h[k])) / (top or 1.0))
                    print(f"epoch {n:>3} {k:>12} {float(h[k]):10.4g} {bar}")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k in keys:
        ax.plot(
            [n for n, h in zip(numbers, history, strict=True) if k in h],
            [float(h[k]) for h in history if k in h],
            marker="o",
            label=k,
        )
    values = [float(h[k]) for h in history for k in keys if k in h]
    ax.set(xlabel="epoch", xticks=numbers, title=title)
    if values and min(values) > 0:
        ax.set_yscale("log")
    ax.legend()
    plt.show()
    plt.close(fig)
    return


class EpochProgress:
    """Receives ``("epoch", logs)`` events from rank 0 and shows them.

    Used as the ``event_callback`` of :func:`spark_estimators.run`. ``history`` keeps every
    epoch's logs, so a driver-side view exists even if training fails later. Call
    :meth:`close` when the fit ends (it restores Spark's console bar).
    """

    def __init__(
        self,
        epochs: int,
        verbose: int = 1,
        start_epoch: int = 0,
        run_id: str | None = None,
        on_epoch: Callable[[dict[str, float]], None] | None = None,
    ):
        self.verbose = verbose
        self.on_epoch = on_epoch
        self.epochs = epochs
        self.run_id = run_id
        self.history: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._bar: Any = None
        self._muted = False
        self._labelled = False
        if verbose < 1 or epochs <= 0:
            return
        with _lock:
            concurrent = bool(_active)
            _active.append(self)
            if concurrent:  # from now on every overlapping fit labels its lines
                for fit in _active:
                    fit._labelled = True
        self._muted = True
        spark_bar_muted = SPARK_CONSOLE_BAR.mute()
        desc = run_id if concurrent and run_id else "epochs"
        if in_notebook():
            if _has_widgets():
                from tqdm.notebook import tqdm as notebook_tqdm

                self._bar = notebook_tqdm(
                    total=epochs, initial=start_epoch, desc=desc, unit="epoch"
                )
            else:
                _hint_once()
        elif spark_bar_muted and not concurrent:
            from tqdm.std import tqdm

            self._bar = tqdm(
                total=epochs, initial=start_epoch, desc=desc, unit="epoch", file=sys.stderr
            )

    def _label(self) -> str:
        return f"[{self.run_id}] " if self._labelled and self.run_id else ""

    def __call__(self, rank: int, kind: str, data: object) -> None:
        """Take one event from a rank: record and show each ``epoch`` event, ignore others."""
        if kind != "epoch":
            return
        logs = cast("dict[str, float]", data)
        with self._lock:
            self.history.append(dict(logs))
            if self.on_epoch is not None:
                try:
                    self.on_epoch(dict(logs))
                except Exception as exc:  # noqa: BLE001 - tracking must not stop training
                    logger.warning("could not record epoch %s: %r", logs.get("epoch"), exc)
            if self.verbose < 1:
                return
            epoch = logs.get("epoch")
            label = epoch_label(epoch, self.epochs) if isinstance(epoch, int) else "epoch ?"
            line = f"{self._label()}{label}: {format_metrics(logs)}"
            if self._bar is not None:
                self._bar.update(1)
                if in_notebook():
                    print(line, flush=True)  # the widget sits in its own output area
                else:
                    self._bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)

    def close(self) -> None:
        """Close the progress bar and give Spark its console progress back."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self._muted:
                self._muted = False
                with _lock:
                    if self in _active:
                        _active.remove(self)
                SPARK_CONSOLE_BAR.unmute()
