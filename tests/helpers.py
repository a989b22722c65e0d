"""Helpers shared by the tests of what stays on a client.

* :data:`SENTINEL`, a distinctive value planted in one client's rows (or state) only, and
  :func:`holds_sentinel` / :func:`holds_value`: whether objects (pickled as an engine would
  send them, closures included) carry it;
* :func:`save_client_rows`: each client's rows in files of their own, and the loader a
  deployment gives its workers.
"""

import os

import numpy as np
import pytest

#: planted in client 1's rows only: distinctive bytes (in float64 and rounded to float32) and a
#: plausible covariate, so that a fit on the planted rows behaves as on the others
SENTINEL = 1.2345678901234567


def holds_value(value, *objects) -> bool:
    """Whether the bytes of ``value`` (float64 or float32) appear in ``objects`` pickled with
    cloudpickle (as Ray sends them: functions with what they close over)."""
    cloudpickle = pytest.importorskip("cloudpickle")
    payload = cloudpickle.dumps(objects)
    return np.float64(value).tobytes() in payload or np.float32(value).tobytes() in payload


def holds_sentinel(*objects) -> bool:
    """:func:`holds_value` of :data:`SENTINEL`."""
    return holds_value(SENTINEL, *objects)


def save_client_rows(folder, bounds, *arrays, record_pids: bool = False):
    """Saves client ``m``'s rows ``arrays[k][bounds[m]:bounds[m + 1]]`` to files of its own in
    ``folder`` and returns ``load(m)``, the deployment loader that reads them back (a tuple,
    one array per ``arrays``). With ``record_pids``, each call also appends the pid of the
    process it runs in to ``folder/pids`` (where the loaders ran)."""
    folder = str(folder)
    bounds = [int(b) for b in bounds]
    for m in range(len(bounds) - 1):
        for k, array in enumerate(arrays):
            np.save(os.path.join(folder, f"a{k}_{m}.npy"), np.asarray(array)[bounds[m] : bounds[m + 1]])
    count = len(arrays)

    def load(m):
        if record_pids:
            with open(os.path.join(folder, "pids"), "a") as f:
                f.write(f"{os.getpid()}\n")
        return tuple(np.load(os.path.join(folder, f"a{k}_{m}.npy")) for k in range(count))

    return load
