"""The server's side of a Flower app (:func:`server_app`, :func:`run`, :func:`apps`,
:func:`simulate`) and :func:`check_method`; see :mod:`numpyro_fed.flower`."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping

import numpy as np

import jax

from numpyro_fed.flower.clientapp import client_app, import_flwr
from numpyro_fed.flower.federation import FlowerFederation

__all__ = ["apps", "as_methods", "check_method", "run", "server_app", "simulate"]

_logger = logging.getLogger("numpyro_fed.flower")


def check_method(method):
    """``method`` if it can run on Flower (a variational method: DPPVI and its relatives,
    DSVGD, PDSVGD, UDSVGD); else an error saying why and what to use instead.

    >>> import numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> from numpyro_fed import flower
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=3):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> flower.check_method(nf.DSVGD(model))  # doctest: +ELLIPSIS
    DSVGD(model, num_particles=20, ...)
    >>> flower.check_method(nf.FedZigZag(model))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: FedZigZag cannot run on Flower: every proposal of its Zig-Zag process is one round trip ...
    """
    from numpyro.infer import MCMC
    from numpyro.infer.mcmc import MCMCKernel

    from numpyro_fed.infer.base import VariationalMethod

    sampler = method.sampler if isinstance(method, MCMC) else method
    name = type(sampler).__name__
    if name == "FedZigZag":
        raise ValueError(
            "FedZigZag cannot run on Flower: every proposal of its Zig-Zag process is one round trip to "
            "the clients (thousands per effective sample), and a Flower round costs about 0.1 s in "
            "simulation and seconds deployed. Run it on nf.RayFederation (a few ms per round)."
        )
    if isinstance(sampler, MCMCKernel):
        raise ValueError(
            f"{name} cannot run on Flower: its agents exchange messages with their neighbours every "
            "iteration and Flower is hub and spoke (every message would go through the server, a round "
            "each). Run it on nf.RayFederation, whose agents message each other directly."
        )
    if not isinstance(sampler, VariationalMethod):
        raise TypeError(f"numpyro_fed.flower runs numpyro_fed's variational methods (DPPVI, DSVGD, ...), not {name}")
    return sampler


def as_methods(methods) -> dict:
    """``methods`` (a method, or a dict name -> method) as a dict, each checked by
    :func:`check_method`."""
    if isinstance(methods, Mapping):
        out = {str(k): check_method(v) for k, v in methods.items()}
    else:
        out = {"method": check_method(methods)}
    if not out:
        raise ValueError("give at least one method")
    return out


def run(
    method,
    grid,
    rng_key,
    num_rounds,
    *,
    name: str = "method",
    init_state=None,
    num_clients: int | None = None,
    timeout: float = 120.0,
    start_timeout: float = 600.0,
):
    """Runs ``method`` (not yet given a federation) on the Flower nodes of ``grid``: its
    ``run(rng_key, num_rounds, init_state=init_state)`` on a :class:`FlowerFederation`,
    without data arguments (each node loads its rows). Call it inside a ``ServerApp``'s main
    function whose ``ClientApp`` is :func:`client_app` with this method under ``name``.

    :return: the method's :class:`~numpyro_fed.infer.RunResult`.
    :raises ClientError: a node failed or did not answer within ``timeout``, naming it; its
        ``state`` resumes the run: ``run(method, grid, rng_key, num_rounds,
        init_state=error.state)``.
    """
    from numpyro_fed.flower.recipe import fresh_method

    check_method(method)
    federation = FlowerFederation(grid, num_clients=num_clients, timeout=timeout, start_timeout=start_timeout)
    key = np.asarray(jax.random.PRNGKey(rng_key) if isinstance(rng_key, int) else rng_key)
    federation.recipe = {"name": name, "rng_key": key, "num_rounds": num_rounds}
    clone = fresh_method(method, federation)
    return clone.run(jax.numpy.asarray(key), num_rounds, init_state=init_state)


def server_app(
    methods,
    num_rounds: int | Mapping[str, int],
    *,
    seed: int = 0,
    on_result: Callable | None = None,
    resume_attempts: int = 1,
    num_clients: int | None = None,
    timeout: float = 120.0,
    start_timeout: float = 600.0,
):
    """A Flower ``ServerApp`` that runs ``methods`` (a method, or a dict name -> method, run
    in turn) for ``num_rounds`` (an int, or a dict by name) with the key ``PRNGKey(seed)``.

    The run config may override ``num-rounds`` and ``seed`` (``flwr run . --run-config
    "num-rounds=20"``), choose ``methods`` (comma-separated names) and set ``num-clients``
    (the nodes to wait for). After each run, ``on_result(name, result,
    context)`` (default: log the result). A :class:`~numpyro_fed.federation.ClientError`
    (a node failed or was silent) is resumed from its checkpoint up to ``resume_attempts``
    times (once the node is back), then re-raised.
    """
    flwr = import_flwr()
    methods = as_methods(methods)
    app = flwr.serverapp.ServerApp()
    results = {}

    @app.main()
    def main(grid, context):
        _wait_for_the_simulation_engine(grid)
        config = dict(context.run_config or {})
        key = jax.random.PRNGKey(int(config.get("seed", seed)))
        wanted = config.get("num-clients", num_clients) or num_clients  # 0: those connected
        chosen = list(methods)
        if config.get("methods"):
            chosen = [n.strip() for n in str(config["methods"]).split(",") if n.strip()]
            unknown = sorted(set(chosen) - set(methods))
            if unknown:
                raise ValueError(f"the run config names method(s) {unknown}; the app has {sorted(methods)}")
        for name in chosen:
            method = methods[name]
            rounds = num_rounds[name] if isinstance(num_rounds, Mapping) else num_rounds
            rounds = int(config.get("num-rounds", rounds))
            result = _run_with_resumption(
                method,
                grid,
                key,
                rounds,
                name=name,
                attempts=resume_attempts,
                num_clients=None if wanted is None else int(wanted),
                timeout=timeout,
                start_timeout=start_timeout,
            )
            results[name] = result
            if on_result is not None:
                on_result(name, result, context)
            else:
                _logger.info("numpyro_fed: %s finished %d rounds; privacy %s", name, rounds, result.privacy)

    app.numpyro_fed_results = results  # what simulate() returns
    return app


def _wait_for_the_simulation_engine(grid, timeout: float = 120.0):
    """In Flower's simulation the ServerApp starts in a thread while the process starts Ray,
    whose ``ray.init`` forks (and execs) its processes: JAX's first operation, which starts
    JAX's threads, waits until Ray is up, so that no fork follows them (JAX warns that a fork
    of a multithreaded process may deadlock). A deployed ServerApp (no in-memory grid) does
    not wait."""
    if type(grid).__name__ != "InMemoryGrid":
        return
    try:
        import ray
    except ImportError:  # pragma: no cover - flwr[simulation] installs Ray
        return
    deadline = time.monotonic() + timeout
    while not ray.is_initialized() and time.monotonic() < deadline:
        time.sleep(0.05)


def _run_with_resumption(method, grid, key, rounds, *, name, attempts, **kwargs):
    from numpyro_fed.federation import ClientError

    init_state = None
    for attempt in range(int(attempts) + 1):
        try:
            return run(method, grid, key, rounds, name=name, init_state=init_state, **kwargs)
        except ClientError as error:
            if attempt == attempts or getattr(error, "state", None) is None:
                raise
            _logger.warning("numpyro_fed: %s; resuming from round %d", error, error.state.rounds_done)
            init_state = error.state


def apps(methods, load: Callable, *, num_rounds, mods=None, **server_options):
    """``(server_app, client_app)``: :func:`server_app` of ``methods`` for ``num_rounds``
    and :func:`client_app` of the same methods with ``load``; ``server_options`` go to
    :func:`server_app` (``seed``, ``on_result``, ``resume_attempts``, ``timeout``, ...).

    >>> import numpy as np, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> from numpyro_fed import flower
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=3):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> def load(node_config):  # node m's rows (here: made up from its partition-id)
    ...     return (np.arange(4.0) + node_config["partition-id"],)
    >>> server, client = flower.apps(nf.DPPVI(model, progress_bar=False), load, num_rounds=3)
    >>> type(server).__name__, type(client).__name__
    ('ServerApp', 'ClientApp')

    ``flower.simulate(server, client, 3)`` then runs them in Flower's simulation and returns
    ``{"method": RunResult}``; in a Flower app's modules, ``app = server`` and ``app =
    client`` are the components ``[tool.flwr.app.components]`` names.
    """
    return (server_app(methods, num_rounds, **server_options), client_app(methods, load, mods=mods))


def simulate(server, client, num_nodes: int, *, num_workers: int = 1, backend_config: dict | None = None) -> dict:
    """Runs ``server`` and ``client`` (from :func:`apps`) in Flower's simulation with
    ``num_nodes`` nodes (node ``m`` has ``partition-id = m`` in its node config) and returns
    ``{name: RunResult}`` of the runs :func:`server_app` made.

    The server runs in this process; the nodes' ``ClientApp`` in ``num_workers`` Flower
    worker processes (Ray actors; a Ray already running in this process is used). One worker
    (the default) serves every node in turn and compiles each client function once; more run
    the nodes of a synchronous round in parallel, each compiling for itself.
    """
    import_flwr()  # Flower, or an ImportError saying how to install it
    import ray
    from flwr.simulation import run_simulation

    num_workers = int(num_workers)
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, not {num_workers}")
    config = dict(backend_config or {})
    init_args = dict(config.get("init_args", {}))
    init_args.setdefault("include_dashboard", False)
    init_args.setdefault("log_to_driver", False)
    if ray.is_initialized():
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
    else:
        init_args.setdefault("num_cpus", num_workers)
        cpus = float(init_args["num_cpus"])
    config.setdefault("client_resources", {"num_cpus": cpus / num_workers, "num_gpus": 0.0})
    config["init_args"] = init_args
    results = getattr(server, "numpyro_fed_results", None)
    if results is not None:
        results.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", ".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", FutureWarning)
        start = time.perf_counter()
        run_simulation(server, client, int(num_nodes), backend_config=config)
        _logger.info("numpyro_fed: the simulation took %.1f s", time.perf_counter() - start)
    return dict(results or {})
