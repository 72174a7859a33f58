"""The collective engine, below the public API and above the backends.

:mod:`.engine` (one background thread per process that negotiates every op with the other
ranks, fuses small ones and runs them on the backend), :mod:`.ops` (the op requests, shared by
the numpy API and the framework adapters), :mod:`.process_sets`, :mod:`.adasum` and
:mod:`.settings` (what the environment and ``init()`` arguments say). Nothing here is public API;
:mod:`spark_estimators.collective` re-exports what users need.
"""
