"""The collective rendezvous store, served by the driver service over its signed RPC.

torch.distributed meets its ranks through a key-value store: each rank publishes its Gloo/NCCL
address (or rank 0 its NCCL unique id) and reads the others'. torch's own ``TCPStore`` on
``MASTER_PORT`` accepts anyone who can reach the port: a process without the job's secret could
list the keys and write its own (an address of its choosing, a forged rank). Instead, every rank
of :func:`spark_estimators.run`, :func:`~spark_estimators.run_elastic` and the estimators reaches
a store kept in the driver service, through the same handshake and HMAC-signed frames as every
other request (:mod:`spark_estimators.driver.rpc`): only holders of the job's secret can read or
write it. :class:`RendezvousKV` is the driver side; the torch ``Store`` the ranks use is in
:mod:`spark_estimators.driver.store_client`.

The store carries only the rendezvous (a few small keys per group), never tensors: collective
speed is unchanged. Keys live in namespaces (one per rendezvous point and init); each request is
one ``("store", (op, namespace, args))`` frame; a blocking ``get``/``wait`` is a long poll of at
most :data:`LONG_POLL_S` that the client repeats until its own timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

#: ``(op, namespace, args)``: one store operation, e.g. ``("set", "ns", ["key", b"value"])``.
StoreRequest = tuple[str, str, Sequence[object]]

#: Longest one blocking request waits in the driver before answering "not yet".
LONG_POLL_S = 5.0


class RendezvousKV:
    """Namespaced key-value store with the semantics of torch's ``TCPStore`` (driver side)."""

    def __init__(self) -> None:
        self._spaces: dict[str, dict[str, bytes]] = {}
        self._cond = threading.Condition()

    def handle(self, request: StoreRequest) -> object:
        """Serve one ``(op, namespace, args)`` request; see :meth:`_op_set` and its siblings."""
        op, namespace, args = request
        method = getattr(self, "_op_" + str(op), None)
        if method is None:
            raise ValueError(f"unknown store operation {op!r}")
        with self._cond:
            space = self._spaces.setdefault(str(namespace), {})
            return method(space, *args)

    def _wait_for(self, space: dict[str, bytes], keys: list[str], timeout: float) -> bool:
        end = time.monotonic() + min(max(float(timeout), 0.0), LONG_POLL_S)
        while not all(k in space for k in keys):
            left = end - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _op_set(self, space: dict[str, bytes], key: str, value: bytes) -> None:
        space[key] = bytes(value)
        self._cond.notify_all()

    def _op_get(
        self, space: dict[str, bytes], keys: list[str], timeout: float
    ) -> list[bytes] | None:
        """The values of ``keys`` once all exist, or None after the long poll."""
        if not self._wait_for(space, keys, timeout):
            return None
        return [space[k] for k in keys]

    def _op_wait(self, space: dict[str, bytes], keys: list[str], timeout: float) -> bool:
        return self._wait_for(space, keys, timeout)

    def _op_check(self, space: dict[str, bytes], keys: list[str]) -> bool:
        return all(k in space for k in keys)

    def _op_add(self, space: dict[str, bytes], key: str, amount: int) -> int:
        value = int(space.get(key, b"0")) + int(amount)
        space[key] = str(value).encode()
        self._cond.notify_all()
        return value

    def _op_compare_set(
        self, space: dict[str, bytes], key: str, expected: bytes, desired: bytes
    ) -> bytes:
        # TCPStore's rule: a missing key is set only when ``expected`` is empty.
        current = space.get(key)
        if current is None:
            if expected:
                return bytes(expected)
            space[key] = bytes(desired)
            self._cond.notify_all()
            return space[key]
        if current == expected:
            space[key] = bytes(desired)
            self._cond.notify_all()
        return space[key]

    def _op_append(self, space: dict[str, bytes], key: str, value: bytes) -> None:
        space[key] = space.get(key, b"") + bytes(value)
        self._cond.notify_all()

    def _op_multi_set(self, space: dict[str, bytes], keys: list[str], values: list[bytes]) -> None:
        for k, v in zip(keys, values, strict=True):
            space[k] = bytes(v)
        self._cond.notify_all()

    def _op_delete(self, space: dict[str, bytes], key: str) -> bool:
        return space.pop(key, None) is not None

    def _op_num_keys(self, space: dict[str, bytes]) -> int:
        return len(space)

    def _op_list_keys(self, space: dict[str, bytes]) -> list[str]:
        return sorted(space)
