"""Issue 27 item 5: what keeps a notebook's output quiet, tested piece by piece.

The notebooks themselves run in tests/notebooks (a real kernel); here each filter gets real
pipes and real streams.
"""

from __future__ import annotations

import io
import os
import sys
import threading

from spark_estimators._base.output import OutputPrinter, _forward_filtered
from spark_estimators.core.progress import format_metrics, history_lines, plot_history

BANNER = [
    "WARNING: Using incubator modules: jdk.incubator.vector",
    "Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties",
    'Setting default log level to "WARN".',
    "To adjust logging level use sc.setLogLevel(newLevel). For SparkR, use setLogLevel(newLevel).",
    "26/11/26 09:54:26 WARN NativeCodeLoader: Unable to load native-hadoop library for your "
    "platform... using builtin-java classes where applicable",
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795686929.485772    5869 port.cc:153] oneDNN custom operations are on.",
]
KEPT = [
    "26/11/26 09:56:42 ERROR Executor: Exception in task 1.0 in stage 0.0 (TID 1)",
    "ZeroDivisionError: division by zero",
]


def test_the_jvm_stderr_filter_drops_the_banner_and_keeps_the_rest():
    source_r, source_w = os.pipe()
    sink_r, sink_w = os.pipe()
    text = "\n".join([BANNER[0], KEPT[0], *BANNER[1:], KEPT[1]]) + "\n"
    cut = text.index("default log level") + 7  # a banner line split across two reads
    os.write(source_w, text[:cut].encode())  # in the pipe before the reader starts: one read
    thread = threading.Thread(target=_forward_filtered, args=(source_r, sink_w))
    thread.start()
    sink = os.fdopen(sink_r, "rb")
    assert sink.readline().decode() == KEPT[0] + "\n"  # the first read was handled
    os.write(source_w, text[cut:].encode())
    os.close(source_w)
    thread.join(10)
    assert sink.read().decode().splitlines() == KEPT[1:]
    sink.close()


def test_rank_output_drops_tensorflow_start_up_lines():
    out, err = io.StringIO(), io.StringIO()
    printer = OutputPrinter(out, err, timestamp=False)
    printer(1, "stderr", [BANNER[5], BANNER[6], "real problem"])
    printer(0, "stderr", [BANNER[5]])
    assert err.getvalue() == "[1]real problem\n"


def test_a_loss_logged_twice_is_shown_once():
    logs = {"epoch": 0, "loss": 7.7341, "train_loss": 7.73412, "val_loss": 0.9993}
    assert format_metrics(logs) == "train_loss=7.734 val_loss=0.9993"
    # a different value is no twin
    assert format_metrics({"epoch": 0, "loss": 1.0, "train_acc": 0.5}) == "loss=1 train_acc=0.5"


def test_plot_history_without_matplotlib_says_how_to_get_the_plot(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import raises ImportError
    history = [{"epoch": 0, "loss": 2.0, "val_loss": 1.0}, {"epoch": 1, "loss": 1.0}]
    assert plot_history(history) is None
    out = capsys.readouterr().out.splitlines()
    assert "pip install 'spark-estimators[notebook]'" in out[0]
    assert [line.split()[:3] for line in out[1:]] == [
        ["epoch", "1", "loss"],
        ["epoch", "1", "val_loss"],
        ["epoch", "2", "loss"],
    ]
    assert history_lines(history)[0].startswith("epoch 1/2: ")
