"""FedZigZag through a federation: Algorithm 2 as messages (every client thinning its own
proposals), in process and on a local Ray; and the server's thinning, the same process."""

import threading
import time
import warnings

import numpy as np
import pytest

import jax

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.federation import ClientError, InProcess

from helpers import SENTINEL, holds_sentinel, save_client_rows


def logistic(X, y=None, clients=2):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3))
    y = (rng.uniform(size=120) < 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))).astype(float)
    return X, y


def run(federation, data, *, num_warmup=20, num_samples=100, seed=0, **options):
    """A short run; given a federation, of Algorithm 2 as messages (``thinning="clients"``)."""
    if federation is not None:
        options = {"thinning": "clients", **options}
    kernel = nf.FedZigZag(logistic, sample_interval=0.5, federation=federation, **options)
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    with federation.guard() if federation is not None else _nothing():
        mcmc.run(jax.random.PRNGKey(seed), *data)
    return kernel, mcmc


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_one_round_per_switch_and_same_posterior_as_in_process_thinning(data):
    """Algorithm 2 as messages (clients thin their own proposals) samples the same posterior
    as the server-side thinning of federation=None (InProcess, thinning "auto"), with one
    round per switch."""
    # in x (preconditioner=None): with the default's whitening, fewer switches and more of the
    # clients' proposals rejected by the grid's bounds (988 rounds for 879 switches)
    _, reference = run(None, data, num_samples=1500, preconditioner=None)
    kernel, mcmc = run(InProcess(), data, num_samples=1500, seed=1, preconditioner=None)
    fields = mcmc.get_extra_fields()
    switches, rounds = int(fields["info.num_events"].sum()), int(fields["info.rounds"].sum())
    assert switches > 1000 and switches <= rounds <= 1.02 * switches
    a, b = reference.get_samples()["w"], mcmc.get_samples()["w"]
    # means agree within a few Monte Carlo standard errors (ESS of either run > 300)
    se = np.sqrt(np.var(a, 0) / 300 + np.var(b, 0) / 300)
    assert np.all(np.abs(a.mean(0) - b.mean(0)) < 4 * se)
    assert np.allclose(a.std(0), b.std(0), rtol=0.2)


def test_ledger_counts_the_protocol(data):
    """Per client and round: x, v, the window, the reference point and mean gradient, the
    client's key, horizon, prior share and shift go out; a time, a coordinate and three
    counts come back; every client takes part in every round."""
    kernel, mcmc = run(InProcess(), data, num_warmup=0, num_samples=50)
    d, f64, i32 = 3, 8, 4
    ledger = kernel.message_ledger(mcmc)
    rounds = int(mcmc.get_extra_fields()["info.rounds"].sum())
    assert ledger["propose/messages_from_client"].tolist() == [rounds, rounds]
    assert ledger["propose/bytes_from_client"].tolist() == [rounds * (f64 + i32 + 3 * i32)] * 2
    # x, v, point, mean gradient, shift (d each), window, horizon, weight (f64), a key (2 x uint32)
    assert ledger["propose/bytes_to_client"].tolist() == [rounds * (5 * d * f64 + 3 * f64 + 2 * i32)] * 2
    # the set-up, as the federation counted it: the mode search's evaluations and the gradients
    # at the reference (d down, d + 1 up), one Hessian per Newton check (d down, d^2 up)
    setup = {name: int(ledger[f"{name}/messages_to_client"][0]) for name in ("value_and_grad", "hessian")}
    assert setup["value_and_grad"] > 5 and setup["hessian"] >= 1
    assert ledger["value_and_grad/bytes_from_client"].tolist() == [setup["value_and_grad"] * (d + 1) * f64] * 2
    assert ledger["value_and_grad/bytes_to_client"].tolist() == [setup["value_and_grad"] * d * f64] * 2
    assert ledger["hessian/bytes_from_client"].tolist() == [setup["hessian"] * d * d * f64] * 2
    assert ledger["messages_from_client"].tolist() == [rounds + setup["value_and_grad"] + setup["hessian"]] * 2
    stats = kernel.sample_stats(mcmc.get_extra_fields(group_by_chain=True))
    assert stats["messages_from_client"][0].shape == (1, 50, 2) and stats["messages_from_client"][1] == ["client"]
    assert stats["bytes_to_client"][0].sum() == ledger["propose/bytes_to_client"].sum()


def test_private_replies_carry_only_time_and_coordinate(data):
    kernel, mcmc = run(
        InProcess(), data, num_warmup=0, num_samples=20, dp_sensitivity=2.0, dp_epsilon=5.0, dp_delta=1e-3
    )
    assert kernel.message_sizes["from_client"] == 8 + 4
    ledger = kernel.message_ledger(mcmc)
    # no set-up: no control variates under the guarantee, so no mode search
    assert not any(name.startswith(("value_and_grad/", "hessian/")) for name in ledger)
    assert ledger["messages_from_client"].sum() == 2 * int(mcmc.get_extra_fields()["info.rounds"].sum())


def test_ray_agrees_bit_for_bit_and_ledgers_match(ray_federation, data):
    """Same model, same key: the draws on Ray equal the in-process ones, and the ledger Ray
    counts from the real payloads equals the one the draws report."""
    _, local = run(InProcess(), data, num_warmup=0, num_samples=60)
    kernel, remote = run(ray_federation, data, num_warmup=0, num_samples=60)
    np.testing.assert_array_equal(np.asarray(local.get_samples()["w"]), np.asarray(remote.get_samples()["w"]))
    counted = ray_federation.ledger.summary()
    reported = kernel.message_ledger(remote)
    assert set(reported) == {name for name in counted if "peer" not in name}
    assert not counted["messages_to_peer"].any()
    for name in reported:
        assert counted[name].tolist() == reported[name].tolist(), name
    assert reported["value_and_grad/messages_to_client"][0] > 0
    # one round trip per round, per set-up call (the BFGS's evaluations, the checks)
    assert (
        ray_federation.ledger.round_trips
        == int(remote.get_extra_fields()["info.rounds"].sum())
        + counted["value_and_grad/rounds"][0]
        + counted["hessian/rounds"][0]
    )


def test_killed_worker_names_the_client_and_the_run_resumes(ray_federation, ray_session, data):
    kernel = nf.FedZigZag(logistic, sample_interval=0.5, federation=ray_federation)
    MCMC(kernel, num_warmup=0, num_samples=5, progress_bar=False).run(jax.random.PRNGKey(2), *data)  # compiles
    ray_federation.timeout = 10.0
    mcmc = MCMC(kernel, num_warmup=10, num_samples=100_000, progress_bar=False)
    killed_at = []

    def kill_after_some_draws():
        while len(kernel.completed_draws) < 30:
            time.sleep(0.05)
        killed_at.append(time.monotonic())
        ray_session.kill(ray_federation.actors[1])

    killer = threading.Thread(target=kill_after_some_draws, daemon=True)
    killer.start()
    with pytest.raises(ClientError, match="client 1") as error:
        with ray_federation.guard():
            mcmc.run(jax.random.PRNGKey(3), *data)
    assert error.value.clients == (1,) and error.value.call == "propose"
    assert time.monotonic() - killed_at[0] < 10.0 + 5.0  # within the timeout (and slack)
    state = kernel.last_completed_state
    assert state is not None and int(state.i) > 10 and len(kernel.completed_draws) == int(state.i)
    # resume: new workers for the same program, then from the last completed draw
    program = ray_federation.program
    ray_federation.close()
    ray_federation.start(program)
    ray_federation.timeout = 120.0
    resumed = MCMC(kernel, num_warmup=0, num_samples=30, progress_bar=False)
    resumed.post_warmup_state = state
    with ray_federation.guard():
        resumed.run(state.rng_key, *data)
    assert resumed.get_samples()["w"].shape == (30, 3)
    assert np.isfinite(resumed.get_samples()["w"]).all()


# -- the set-up through the federation, and deployment (each client loads its own rows) ------


def planted(data):
    X, y = data
    X = X.copy()
    X[60, 0] = SENTINEL  # client 1's first row (two even clients of 60 rows)
    return X, y


def per_client_loader(tmp_path, data, dtype=np.float64):
    """Client m's rows in its own files; the loader records the process that reads them
    (:func:`loader_pids`)."""
    X, y = data
    return save_client_rows(tmp_path, [0, 60, 120], X.astype(dtype), y.astype(dtype), record_pids=True)


def loader_pids(tmp_path):
    return {int(line) for line in (tmp_path / "pids").read_text().split()}


def deployed_run(federation, *, num_warmup=20, num_samples=30, seed=0, **options):
    kernel = nf.FedZigZag(logistic, sample_interval=0.5, federation=federation, **{"thinning": "clients", **options})
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    with federation.guard():
        mcmc.run(jax.random.PRNGKey(seed))
    return kernel, mcmc


@pytest.mark.parametrize(
    "options",
    [{}, pytest.param({"preconditioner": "laplace", "control_variates": "second_order"}, marks=pytest.mark.slow)],
    ids=["default", "laplace-second-order"],
)
def test_the_set_up_through_a_federation_equals_the_pooled_one(data, options):
    """The mode search, the gradients at the reference and the Laplace preconditioner come
    from the clients' replies, whoever thins; they equal what the pooled blocks give to
    round-off."""
    from numpyro_fed.infer import zigzag
    from numpyro_fed.infer.zigzag.mode import find_mode
    from numpyro_fed.infer.zigzag.preconditioning import laplace_preconditioner

    key = jax.random.PRNGKey(0)
    found = {}
    for thinning in ("server", "clients"):
        kernel = nf.FedZigZag(logistic, federation=InProcess(), thinning=thinning, **options)
        state = kernel.init(key, 0, None, data, {})  # the set-up only: nothing is sampled
        found[thinning] = kernel, state.adapt.reference
        hessians = kernel.federation.ledger.summary().get("hessian/messages_to_client", [0])[0]
    (server, a), (asked, b) = found["server"], found["clients"]
    potential = asked.federated_potential
    pooled_potential = jax.jit(potential.flat().potential)
    pooled = find_mode(pooled_potential, asked.reference_point + 0.1)
    assert pooled.is_mode and asked.mode_search.is_mode and server.mode_search.is_mode
    np.testing.assert_allclose(asked.reference_point, pooled.point, rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(server.reference_point, asked.reference_point)  # the same calls
    second = options.get("control_variates") == "second_order"
    preconditioned = asked.preconditioning is not None  # the default's Laplace preconditioner too
    assert preconditioned and server.preconditioning is not None
    proposers, _ = zigzag.proposers_from_potential(potential)
    pooled_pre = None
    if preconditioned:
        pooled_pre = laplace_preconditioner(pooled_potential, asked.reference_point, diagonal=False)
        np.testing.assert_allclose(asked.preconditioning.scale, pooled_pre.scale, rtol=1e-6, atol=1e-8)
        proposers = zigzag.precondition(proposers, pooled_pre)
    point = b.point
    pooled_reference = zigzag.control_variate_reference(proposers, point, order=1 + second)
    for name in ("term_grads", "prior_grad") + (("term_hessians", "prior_hessian") if second else ()):
        np.testing.assert_allclose(
            getattr(b, name), getattr(pooled_reference, name), rtol=1e-6, atol=1e-6, err_msg=name
        )
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    # a Hessian per Newton check, one for the Laplace preconditioner and one for the second order
    assert hessians >= 1 + preconditioned + second


@pytest.mark.parametrize(
    "options",
    [
        {},
        # reproducible only without the clients' private randomness (the default in deployment)
        pytest.param(
            {"dp_sensitivity": 2.0, "dp_epsilon": 5.0, "dp_delta": 1e-3, "private_randomness": False},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["default", "private"],
)
def test_deployment_equals_simulation_bit_for_bit(data, tmp_path, options):
    """Each client loads its own rows (InProcess(loader=...)): the same draws, set-up and
    ledger as the simulation that cuts the pooled rows, for the same key."""
    _, simulated = run(InProcess(), data, num_samples=30, **options)
    loader = per_client_loader(tmp_path, data)
    kernel, deployed = deployed_run(InProcess(loader=loader, num_clients=2), **options)
    assert kernel.federated_potential.deployed
    np.testing.assert_array_equal(np.asarray(deployed.get_samples()["w"]), np.asarray(simulated.get_samples()["w"]))
    assert kernel.privacy is None or "value_and_grad/messages_to_client" not in kernel.message_ledger(deployed)


@pytest.mark.slow
def test_deployment_in_float32(data, tmp_path):
    """Deployment and simulation in float32: both run, with the same draws."""
    numpyro.enable_x64(False)
    try:
        data32 = tuple(a.astype(np.float32) for a in data)
        _, simulated = run(InProcess(), data32, num_samples=20)
        kernel, deployed = deployed_run(
            InProcess(loader=per_client_loader(tmp_path, data, np.float32), num_clients=2), num_samples=20
        )
        w = np.asarray(deployed.get_samples()["w"])
        assert w.dtype == np.float32 and np.isfinite(w).all()
        np.testing.assert_array_equal(w, np.asarray(simulated.get_samples()["w"]))
        assert kernel.message_dims[1] == 4
    finally:
        numpyro.enable_x64(True)


@pytest.mark.slow
def test_deployment_on_ray_agrees_and_the_driver_holds_no_row(ray_session, data, tmp_path):
    """On a local Ray each worker loads its own rows (the loader runs in the workers'
    processes only); the run agrees with the in-process one, and nothing the driver keeps
    (the sampler, its potential, the federation's program, the draws, the InferenceData)
    holds a row of a client."""
    import os

    from numpyro_fed.federation.ray_backend import RayFederation

    rows = planted(data)
    simulation, simulated = run(InProcess(), rows, num_warmup=0, num_samples=30)
    assert holds_sentinel(simulation.federation.blocks)  # the check sees rows when they are there
    loader = per_client_loader(tmp_path, rows)
    with RayFederation(loader=loader, num_clients=2, timeout=120.0) as federation:
        kernel, deployed = deployed_run(federation, num_warmup=0, num_samples=30)
        assert os.getpid() not in loader_pids(tmp_path) and len(loader_pids(tmp_path)) == 2
        np.testing.assert_allclose(
            np.asarray(deployed.get_samples()["w"]), np.asarray(simulated.get_samples()["w"]), rtol=1e-6, atol=1e-8
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # few effective draws: a short run
            idata = nf.to_inference_data(deployed)
        potential = kernel.federated_potential
        assert potential.deployed
        assert not holds_sentinel(
            potential.prior_potential_fn,
            potential.client_potential_fn,
            potential.postprocess_fn,
            potential.block_loader,
            potential.init_params,
            federation.program,
            federation.block_specs,
            deployed.get_samples(),
            deployed.get_extra_fields(),
            kernel.message_ledger(deployed),
            kernel.mode_search,
            kernel.last_state if hasattr(kernel, "last_state") else None,
            deployed.last_state,
        )
        assert not holds_sentinel(idata.to_dict() if hasattr(idata, "to_dict") else idata)
        # (its compiled sample function is left out: its closure reaches pytest's capture files)
        fields = lambda sampler: {k: v for k, v in vars(sampler).items() if k != "_sample_fn"}  # noqa: E731
        assert not holds_sentinel(fields(kernel))
    assert holds_sentinel(fields(simulation))  # the simulation's sampler holds the rows it cut


def test_deployment_on_ray_loads_on_the_workers_only(ray_session, data, tmp_path):
    """The quick sibling of the test above (CI): a short deployed run on a local Ray; the
    loaders ran in the workers' processes, and the driver's objects hold no client row."""
    import os

    from numpyro_fed.federation.ray_backend import RayFederation

    loader = per_client_loader(tmp_path, planted(data))
    with RayFederation(loader=loader, num_clients=2, timeout=120.0) as federation:
        kernel, mcmc = deployed_run(federation, num_warmup=0, num_samples=5)
        assert os.getpid() not in loader_pids(tmp_path) and len(loader_pids(tmp_path)) == 2
        assert np.isfinite(np.asarray(mcmc.get_samples()["w"])).all() and kernel.mode_search.is_mode
        assert not holds_sentinel(
            {k: v for k, v in vars(kernel).items() if k != "_sample_fn"},
            federation.program,
            mcmc.get_samples(),
            mcmc.last_state,
        )
        assert (
            federation.ledger.summary()["value_and_grad/messages_from_client"].tolist()
            == kernel.message_ledger(mcmc)["value_and_grad/messages_from_client"].tolist()
        )


def test_private_randomness_the_server_cannot_reproduce(data, tmp_path):
    """private_randomness=True: each client folds the server's key with a seed it drew where
    it loaded its rows, so the same rng_key gives other draws (the price: no reproducibility),
    while nothing else changes (the messages, the set-up)."""
    with pytest.raises(ValueError, match="needs thinning='clients'"):
        nf.FedZigZag(logistic, private_randomness=True, thinning="server")
    assert nf.FedZigZag(logistic, private_randomness=True).thinning == "clients"
    loader = per_client_loader(tmp_path, data)
    draws, ledgers = [], []
    for _ in range(2):
        kernel, mcmc = deployed_run(
            InProcess(loader=loader, num_clients=2), num_warmup=0, num_samples=20, private_randomness=True
        )
        draws.append(np.asarray(mcmc.get_samples()["w"]))
        ledgers.append(kernel.message_ledger(mcmc))
    assert np.isfinite(draws[0]).all() and not np.array_equal(draws[0], draws[1])
    assert kernel.message_sizes["from_client"] == 8 + 4 + 3 * 4  # the seed never crosses the wire
    assert (
        ledgers[0]["value_and_grad/messages_from_client"].tolist()
        == ledgers[1]["value_and_grad/messages_from_client"].tolist()
    )


def gaussian_mean(y, clients=3):
    mu = numpyro.sample("mu", dist.Normal(0, 10).expand([y.shape[1]]).to_event(1))
    with nf.federated_plate("data", y.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(mu, 1.0).to_event(1), obs=y)


@pytest.mark.parametrize("thinning", ["auto", "clients"], ids=["server_thins", "clients_thin"])
def test_server_thinning_and_clients_thinning_sample_the_closed_form(thinning):
    """The superposition of the clients' proposals thinned by the server (``federation=None``:
    InProcess, thinning "auto") and every client thinning its own proposals (Algorithm 2 as
    messages, ``thinning="clients"``) are the same
    process: each run's means and sds agree with the conjugate posterior within 4.5 Monte
    Carlo standard errors (ESS-based; all six checks of a run fail together with probability
    below 1e-4)."""
    y = 0.5 + jax.random.normal(jax.random.PRNGKey(3), (60, 3))
    precision = 60 + 10.0**-2
    mean, sd = np.asarray(y.sum(0)) / precision, 1 / np.sqrt(precision)
    kernel = nf.FedZigZag(gaussian_mean, thinning=thinning)
    assert kernel.thinning == ("server" if thinning == "auto" else "clients")
    mcmc = MCMC(kernel, num_warmup=200, num_samples=3000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(4), y)
    draws = np.asarray(mcmc.get_samples()["mu"])
    ess = effective_sample_size(draws[None])
    assert np.all(ess > 300), ess
    assert np.all(np.abs(draws.mean(0) - mean) < 4.5 * sd / np.sqrt(ess)), (draws.mean(0) - mean) / sd
    assert np.all(np.abs(draws.std(0) / sd - 1) < 4.5 / np.sqrt(2 * ess)), draws.std(0) / sd


class _Elsewhere(InProcess):
    """A backend whose clients do not run inside the server's program (as an engine's)."""

    in_process = False


def test_thinning_follows_the_federation_s_capability():
    """``federation=None`` is ``InProcess()``; ``thinning="auto"`` is the server's thinning
    where the federation runs in process, the clients' elsewhere, and the server's thinning
    is refused where the clients run elsewhere."""
    default = nf.FedZigZag(logistic)
    assert isinstance(default.federation, InProcess) and default.thinning == "server"
    assert nf.FedZigZag(logistic, federation=_Elsewhere()).thinning == "clients"
    with pytest.raises(ValueError, match="thinning='server'.*_Elsewhere runs its clients elsewhere"):
        nf.FedZigZag(logistic, federation=_Elsewhere(), thinning="server")
    with pytest.raises(ValueError, match="thinning must be one of"):
        nf.FedZigZag(logistic, thinning="nobody")


def test_the_server_s_thinning_ledger(data):
    """The server's thinning asks every client for its gradient and slope at every
    evaluation of a line's bound, and the winner of each proposal alone for its gradient:
    together the clients' gradient evaluations; the set-up calls as with the clients'
    thinning."""
    kernel, mcmc = run(None, data, num_warmup=0, num_samples=50)
    d, f64 = 3, 8
    ledger = kernel.message_ledger(mcmc)
    fields = mcmc.get_extra_fields()
    evals = np.asarray(fields["info.grad_evals_by_proposer"]).sum(0)
    lines, checks = ledger["grad_and_slope/messages_to_client"], ledger["grad/messages_to_client"]
    assert lines[0] == lines[1] > 0 and (lines + checks).tolist() == evals[:2].tolist()
    # the server's prior proposer makes the other proposals: every proposal has one winner
    assert checks.sum() + evals[2] - lines[0] == int(fields["info.num_proposals"].sum())
    assert ledger["grad_and_slope/bytes_from_client"].tolist() == (lines * 2 * d * f64).tolist()
    assert ledger["grad/bytes_to_client"].tolist() == (checks * d * f64).tolist()
    setup = {name: int(ledger[f"{name}/messages_to_client"][0]) for name in ("value_and_grad", "hessian")}
    assert ledger["value_and_grad/messages_from_client"].tolist() == [setup["value_and_grad"]] * 2
    assert (
        ledger["messages_from_client"].tolist()
        == (lines + checks + setup["value_and_grad"] + setup["hessian"]).tolist()
    )
