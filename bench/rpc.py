"""Driver-service RPC cost: ours vs multiprocessing.connection, the stdlib's authenticated RPC.

Usage: .venv/bin/python bench/rpc.py [--repeats 200]

Both sides authenticate a connection with an HMAC challenge-response on a per-job key
(``multiprocessing.connection`` with ``authkey``: one challenge each way) and send pickled
messages over TCP on 127.0.0.1, the server answering on its own thread. Ours also signs every
frame. Cases, each timed in the same run, in alternating order:

- connect + first call (the handshake, as a Spark task or a rank process pays it once);
- one small call on an open connection;
- one call carrying 16 MiB each way.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Listener

from spark_estimators.driver.frames import new_secret
from spark_estimators.driver.rpc import RpcClient, RpcServer

BIG = b"x" * (16 << 20)


def _mp_server(listener: Listener, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            conn = listener.accept()
        except OSError:
            return

        def serve(conn=conn) -> None:
            try:
                while True:
                    kind, data = conn.recv()
                    conn.send(("ok", data))
            except (EOFError, OSError):
                conn.close()

        threading.Thread(target=serve, daemon=True).start()


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    secret = new_secret()
    ours = RpcServer(secret, lambda kind, data, conn: data)
    listener = Listener(("127.0.0.1", 0), authkey=secret)
    stop = threading.Event()
    threading.Thread(target=_mp_server, args=(listener, stop), daemon=True).start()

    def ours_connect() -> None:
        with RpcClient(ours.address, secret) as c:
            assert c.call("ping", 1) == 1

    def mp_connect() -> None:
        with Client(listener.address, authkey=secret) as c:
            c.send(("ping", 1))
            assert c.recv() == ("ok", 1)

    ours_client = RpcClient(ours.address, secret)
    mp_client = Client(listener.address, authkey=secret)

    def ours_call() -> None:
        assert ours_client.call("ping", 1) == 1

    def mp_call() -> None:
        mp_client.send(("ping", 1))
        assert mp_client.recv() == ("ok", 1)

    def ours_big() -> None:
        assert len(ours_client.call("big", BIG)) == len(BIG)

    def mp_big() -> None:
        mp_client.send(("big", BIG))
        assert len(mp_client.recv()[1]) == len(BIG)

    cases = [
        ("connect + first call", ours_connect, mp_connect, args.repeats),
        ("small call", ours_call, mp_call, args.repeats),
        ("16 MiB each way", ours_big, mp_big, max(5, args.repeats // 20)),
    ]
    print(f"{'case':22s} {'ours ms':>9s} {'stdlib ms':>10s} {'ours/stdlib':>12s}")
    for name, a, b, n in cases:
        a(), b()  # warm-up
        ta, tb = [], []
        for i in range(n):  # alternate so that load from other work hits both alike
            first, second = (a, b) if i % 2 == 0 else (b, a)
            t1, t2 = timed(first, 1)[0], timed(second, 1)[0]
            ta.append(t1 if first is a else t2)
            tb.append(t2 if first is a else t1)
        ma, mb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
        print(f"{name:22s} {ma:9.3f} {mb:10.3f} {ma / mb:12.2f}")
    ours_client.close()
    mp_client.close()
    stop.set()
    listener.close()
    ours.close()


if __name__ == "__main__":
    main()
