"""The ranks' side of the authenticated rendezvous store (see :mod:`.kvstore`).

:func:`driver_store` returns a ``torch.distributed.Store`` whose every operation is a signed
request to the driver service. :func:`install_env_rendezvous` makes torch's own ``env://`` and
``tcp://`` rendezvous use it in a rank process (Lightning's DDP strategy and a user's plain
``init_process_group("gloo")`` go through them), so no rank process opens a ``TCPStore`` on
``MASTER_PORT``; :func:`spark_estimators.collective.init` finds it through the same patched
module (``_create_c10d_store.driver_store_for``), since the collective layer may not import the
driver or task layers. torch is imported only when a store is made or ``torch.distributed`` is
imported by the rank's code.
"""

from __future__ import annotations

import datetime
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from spark_estimators import envvars as ev
from spark_estimators.driver.kvstore import StoreRequest

if TYPE_CHECKING:
    import torch.distributed as dist

    from spark_estimators.driver.rpc import RpcClient

#: Returns the rank's connection to its driver service (None: leave torch's own store).
DriverLink = Callable[[], "RpcClient | None"]

RENDEZVOUS_MODULE = "torch.distributed.rendezvous"

_store_class: type | None = None
# torch holds a store only by its C++ half: a Python subclass whose Python object is collected
# fails every later call ("Not implemented"). Every store made here lives as long as the process.
_made: list[object] = []
_env_inits: dict[str, int] = {}
_env_lock = threading.Lock()


class _Pool:
    """Connections to the driver for one store: a blocked ``get`` never delays another thread."""

    def __init__(self, parent: RpcClient):
        self._parent = parent
        self._idle: list[RpcClient] = []
        self._lock = threading.Lock()

    def call(self, request: StoreRequest) -> Any:
        with self._lock:
            client = self._idle.pop() if self._idle else None
        if client is None:
            client = self._parent.another(timeout=None)
        try:
            reply = client.call("store", request)
        except BaseException:
            client.close()
            raise
        with self._lock:
            self._idle.append(client)
        return reply


def _make_class() -> type:
    import torch.distributed as dist

    class DriverStore(dist.Store):
        """A ``torch.distributed.Store`` kept by the driver service (authenticated, signed)."""

        def __init__(self, pool: _Pool, namespace: str, timeout: datetime.timedelta):
            super().__init__()
            self._pool = pool
            self._ns = namespace
            self._timeout_s = timeout.total_seconds()

        def _call(self, op: str, *args: Any) -> Any:
            return self._pool.call((op, self._ns, args))

        def _blocking(self, op: str, keys: list[str], timeout: float | None) -> Any:
            wait_s = self._timeout_s if timeout is None else timeout
            end = time.monotonic() + wait_s
            while True:
                reply = self._call(op, keys, max(0.0, end - time.monotonic()))
                if reply is not None and reply is not False:
                    return reply
                if time.monotonic() >= end:
                    raise RuntimeError(  # torch raises its DistStoreError (a RuntimeError)
                        f"timed out after {wait_s:g}s waiting for rendezvous keys {keys} "
                        "(a rank did not arrive)"
                    )

        def set(self, key: str, value: str | bytes) -> None:
            self._call("set", key, _bytes(value))

        def get(self, key: str) -> bytes:
            return bytes(self._blocking("get", [key], None)[0])

        def multi_get(self, keys: Sequence[str]) -> list[bytes]:
            return [bytes(v) for v in self._blocking("get", list(keys), None)]

        def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
            self._call("multi_set", list(keys), [_bytes(v) for v in values])

        def add(self, key: str, amount: int) -> int:
            return int(self._call("add", key, int(amount)))

        def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
            return bytes(self._call("compare_set", key, _bytes(expected), _bytes(desired)))

        def append(self, key: str, value: str | bytes) -> None:
            self._call("append", key, _bytes(value))

        def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
            seconds = None if timeout is None else timeout.total_seconds()
            self._blocking("wait", list(keys), seconds)

        def check(self, keys: Sequence[str]) -> bool:
            return bool(self._call("check", list(keys)))

        def delete_key(self, key: str) -> bool:
            return bool(self._call("delete", key))

        def num_keys(self) -> int:
            return int(self._call("num_keys"))

        def list_keys(self) -> list[str]:
            return list(self._call("list_keys"))

        def has_extended_api(self) -> bool:
            return True

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self._timeout_s = timeout.total_seconds()

    return DriverStore


def _bytes(value: str | bytes) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def driver_store(driver: RpcClient, namespace: str, timeout: float) -> dist.Store:
    """A ``torch.distributed.Store`` in ``namespace`` of the store of ``driver``'s service.

    ``driver`` is an :class:`~spark_estimators.driver.rpc.RpcClient` (the rank's own connection;
    the store opens its own connections next to it).
    """
    global _store_class
    if _store_class is None:
        _store_class = _make_class()
    store: dist.Store = _store_class(_Pool(driver), namespace, datetime.timedelta(seconds=timeout))
    _made.append(store)
    return store


# -- torch's env:// and tcp:// rendezvous in rank processes --------------------------------------
def _patch(module: types.ModuleType, driver: DriverLink) -> None:
    original = module._create_c10d_store
    if getattr(original, "__se_driver_store__", False):
        return

    def driver_store_for(
        hostname: str, port: int, world_size: int, timeout: float
    ) -> dist.Store | None:
        """The driver store for the job's rendezvous point; None for any other address."""
        client = driver()
        ours = os.environ.get(ev.MASTER_ADDR), os.environ.get(ev.MASTER_PORT)
        if client is None or (str(hostname), str(port)) != ours:
            return None
        # Each rendezvous of this process gets a fresh namespace (every rank counts the same).
        with _env_lock:
            base = f"{hostname}:{port}/{world_size}"
            _env_inits[base] = _env_inits.get(base, 0) + 1
            namespace = f"{base}/{_env_inits[base]}"
        return driver_store(client, namespace, timeout)

    def create_store(
        hostname: str,
        port: int,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        *args: object,
    ) -> dist.Store:
        store = driver_store_for(hostname, port, world_size, timeout.total_seconds())
        if store is None:
            return original(hostname, port, rank, world_size, timeout, *args)
        return store

    create_store.__se_driver_store__ = True  # type: ignore[attr-defined]
    # The collective backend asks through the patched module (it may not import this layer).
    create_store.driver_store_for = driver_store_for  # type: ignore[attr-defined]
    module._create_c10d_store = create_store  # type: ignore[attr-defined]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``torch.distributed.rendezvous`` right after it is first imported."""

    def __init__(self, driver: DriverLink):
        self._driver = driver

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != RENDEZVOUS_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader, driver = spec.loader, self._driver
        exec_module = loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            _patch(module, driver)

        spec.loader = _Loader(loader, exec_and_patch)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(
        self, inner: importlib.abc.Loader, exec_module: Callable[[types.ModuleType], None]
    ):
        self._inner = inner
        self._exec = exec_module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._exec(module)


def install_env_rendezvous(driver: DriverLink) -> None:
    """Make ``env://``/``tcp://`` rendezvous at ``MASTER_ADDR:MASTER_PORT`` use the driver store.

    ``driver()`` returns the rank's :class:`~spark_estimators.driver.rpc.RpcClient` (None: leave
    torch's own store). Called once by a rank process's entry point.
    """
    module = sys.modules.get(RENDEZVOUS_MODULE)
    if module is not None:
        _patch(module, driver)
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(driver))
