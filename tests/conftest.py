import os
import sys

import numpyro

# Correctness tests run in float64 (the split must match NumPyro to round-off).
numpyro.enable_x64()
sys.path.insert(0, os.path.dirname(__file__))

SHARED_DATA = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "shared", "data")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (small, no dashboard), shut down at the end."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'numpyro_fed[ray]')")
    import warnings

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    started = not ray.is_initialized()
    if started:
        with warnings.catch_warnings():
            # Ray starts its processes with fork+exec; JAX warns of fork in a threaded process.
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_federation(ray_session):
    """One RayFederation for a test module: each test starts its clients with its own program
    (the actors are reused: starting a process that imports JAX is what costs)."""
    from numpyro_fed import RayFederation

    federation = RayFederation(timeout=120.0)  # the first call compiles on each worker: a loaded machine
    yield federation
    federation.close()


def pytest_collection_modifyitems(config, items):
    """A test that starts Ray workers (it uses the ``ray_session`` fixture) or Flower's
    simulation (``tests/flower/test_flower.py``) is an ``engine`` test: ``make test-engines``
    runs them, ``make test`` does not (each starts processes that import JAX and compile)."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) or item.nodeid.startswith("tests/flower/test_flower.py"):
            item.add_marker(pytest.mark.engine)
