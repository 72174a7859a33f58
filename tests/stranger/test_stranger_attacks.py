"""Attacks by another local user on the surfaces our processes leave on a shared host.

Each test fails on the code before issue 40: the planted scratch dir made the next rank start
delete a directory of ours, a stranger bound the zygote's address after it ended and received the
next fit's rank config, a silent connection to the local mesh held rank 0 until the start timeout
and then ended ``init()``, and a key directory made by the stranger would have been used.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading

import pytest

from tests.stranger.conftest import stranger_popen, stranger_run, stranger_uid

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

PLANT = r"""
import json, os, subprocess, sys
base, victim = sys.argv[1], sys.argv[2]
with open("/proc/sys/kernel/random/boot_id") as f:
    host = f.read().strip() + "/" + os.readlink("/proc/self/ns/pid")
dead = subprocess.Popen(["true"]); dead.wait()            # a pid that no longer runs
path = os.path.join(base, "se-rank-planted-%d" % os.getpid())
os.mkdir(path, 0o755)
with open(os.path.join(path, ".owner"), "w") as f:
    json.dump({"host_id": host, "pid": dead.pid, "start": "1"}, f)
with open(os.path.join(path, ".remove-at-exit"), "w") as f:
    f.write(victim + "\n")
print(path)
"""


def _scratch_base() -> str:
    return os.path.dirname(os.environ["SPARK_ESTIMATORS_RANK_SCRATCH"])


def _rank_and_size() -> tuple[int, int]:
    import os

    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def test_a_planted_stale_scratch_dir_deletes_nothing_of_ours(spark, tmp_path, stranger):
    from spark_estimators import run

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "model.pt").write_bytes(b"precious")
    base = run(_scratch_base, num_proc=1, spark=spark, verbose=0)[0]
    planted = stranger_run(PLANT, base, str(victim)).strip()
    try:
        assert os.stat(planted).st_uid == stranger_uid()
        ranks = run(_rank_and_size, num_proc=2, spark=spark, verbose=0)  # each rank start cleans
        assert ranks == [(0, 2), (1, 2)]
        assert (victim / "model.pt").read_bytes() == b"precious"  # the listed dir is untouched
        assert os.path.isdir(planted)  # and the stranger's dir is not ours to remove either
    finally:
        import shutil

        shutil.rmtree(planted, ignore_errors=True)


SQUAT = r"""
import select, socket, sys
listeners = []
for name in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\0" + name)
    s.listen(8)
    listeners.append(s)
print("ready", flush=True)
got = 0
while True:
    ready = select.select([sys.stdin, *listeners], [], [], 60)[0]
    if not ready or sys.stdin in ready:
        break
    for s in ready:
        conn, _ = s.accept()
        conn.settimeout(5)
        try:
            data, fds, _, _ = socket.recv_fds(conn, 65536, 8)
        except OSError:
            data, fds = b"", []
        got += len(data) + len(fds)
        conn.close()
print("received", got, flush=True)
"""


def _zygote_names() -> set[str]:
    with open("/proc/net/unix") as f:
        fields = [line.split() for line in f.readlines()[1:]]
    return {row[-1][1:] for row in fields if row[-1].startswith("@spark-estimators-zygote-")}


def _our_zygotes() -> list:
    import psutil

    marker = os.environ["SPARK_ESTIMATORS_TEST_SESSION"]
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        try:
            if "spark_estimators.task.spare_process" not in cmd:
                continue
            parent = proc.parent()
            if parent is not None and "spark_estimators.task.spare_process" in parent.cmdline():
                continue  # a forked rank, not a zygote
            if proc.environ().get("SPARK_ESTIMATORS_TEST_SESSION") == marker:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return found


def _forked_probe() -> tuple[int, bool]:
    import os
    import sys

    return int(os.environ["RANK"]), "torch" in sys.modules


def test_a_squatted_zygote_address_gets_nothing_and_the_fit_still_works(spark, stranger):
    import psutil

    from spark_estimators import run
    from spark_estimators.task import spare

    probe = spare.with_preimports(_forked_probe, "torch")
    assert [r for r, _ in run(probe, num_proc=2, spark=spark, verbose=0)] == [0, 1]
    zygotes = _our_zygotes()
    names = _zygote_names()
    assert zygotes and names, "the first fit left no zygote to squat"
    for proc in zygotes:  # as after its idle exit
        proc.kill()
    psutil.wait_procs(zygotes, timeout=30)
    names -= _zygote_names()  # only the names our zygotes held (others may run on this host)
    assert names, "killing our zygotes freed no address"
    squatter = stranger_popen(SQUAT, *sorted(names))
    try:
        assert squatter.stdout is not None
        assert squatter.stdout.readline().strip() == "ready"
        results = run(probe, num_proc=2, spark=spark, verbose=0)
        assert [r for r, _ in results] == [0, 1]
        assert all(forked for _, forked in results)  # a new zygote of ours forked them
    finally:
        out, err = squatter.communicate(input="", timeout=60)
    assert out.strip() == "received 0", out + err  # no request, no fds, no config


SILENT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])
print("connected", flush=True)
sys.stdin.read()   # hold the connection, say nothing
"""


def test_a_silent_stranger_on_the_local_mesh_does_not_hold_rank_0(stranger):
    torch = pytest.importorskip("torch")
    from spark_estimators.collective.backends.local_mesh import LocalMesh

    store = torch.distributed.HashStore()
    meshes: dict[int, object] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            meshes[r] = LocalMesh.connect(store, r, 2, timeout=30, start_timeout=20)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    zero = threading.Thread(target=rank, args=(0,))
    zero.start()
    name = store.get("spark_estimators/mesh/0").decode().rsplit(":", 1)[0]
    silent = stranger_popen(SILENT, name)
    try:
        assert silent.stdout is not None
        assert silent.stdout.readline().strip() == "connected"  # queued before rank 1
        one = threading.Thread(target=rank, args=(1,))
        one.start()
        one.join(60)
        zero.join(60)
    finally:
        silent.kill()
        silent.wait()
    assert not errors, errors
    assert all(meshes[r] is not None for r in (0, 1))  # refused at once: the mesh still forms
    import numpy as np

    results: list = [None, None]

    def gather(r: int) -> None:
        results[r] = meshes[r].allgather(np.array([r + 10]))  # type: ignore[attr-defined]

    threads = [threading.Thread(target=gather, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [row.tolist() for row in results[0]] == [[10], [11]]
    for mesh in meshes.values():
        mesh.close()  # type: ignore[attr-defined]


PRECREATE = r"""
import os, sys
os.mkdir(os.path.join(sys.argv[1], "spark-estimators-0"), 0o777)
os.chmod(os.path.join(sys.argv[1], "spark-estimators-0"), 0o777)
"""


def test_a_key_dir_made_by_a_stranger_is_not_used(monkeypatch, stranger):
    from spark_estimators.task import spare

    base = tempfile.mkdtemp(prefix="se-shared-tmp-")
    os.chmod(base, 0o1777)  # a temp dir every user can write to, as /tmp
    try:
        stranger_run(PRECREATE, base)
        monkeypatch.setattr(tempfile, "tempdir", base)
        assert spare.zygote_key() is None  # no zygote rather than a key others can read
        assert os.listdir(os.path.join(base, "spark-estimators-0")) == []
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


READ_KEY = r"""
import sys
try:
    open(sys.argv[1]).read()
    print("read")
except PermissionError:
    print("denied")
"""


def test_the_zygote_key_cannot_be_read_by_a_stranger(stranger):
    from spark_estimators.task import spare

    key = spare.zygote_key()
    assert key is not None and len(key) == 32
    path = os.path.join(tempfile.gettempdir(), f"spark-estimators-{os.geteuid()}", "zygote.key")
    assert stranger_run(READ_KEY, path).strip() == "denied"


def test_stranger_helpers_really_switch_user(stranger):
    out = stranger_run("import os; print(os.getuid())")
    assert int(out) == stranger_uid() != os.geteuid()
    assert json.loads(json.dumps(int(out))) == stranger_uid()
