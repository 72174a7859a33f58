"""The ground floor: helpers that every layer of the package may import.

Modules here import nothing of ``spark_estimators`` except :mod:`spark_estimators.errors`,
:mod:`spark_estimators.envvars` and each other, so the driver side (``runner``, ``elastic``,
``core``), the rank side (``task``) and ``data`` can all use them without an import running back
up. ``tests/unit/test_import_graph.py`` checks it.

- :mod:`.session`: finding the Spark session and asking it about slots, jobs and the driver host
  (public as :mod:`spark_estimators.core.session`);
- :mod:`.pickling`: cloudpickle with the user's own modules by value;
- :mod:`.output`: printing the ranks' output lines with their rank;
- :mod:`.environ`: checking a user's ``env=`` for the rank processes;
- :mod:`.child`: what every rank process does around the user's function (read its settings,
  die with its parent, flush and exit);
- :mod:`.processes`: the parent's side (kill a rank's process group, its exit in words).
"""
