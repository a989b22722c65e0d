"""D-ADMMS on a federation: the agents as Ray actors exchanging their iterates with their
neighbors directly agree with the in-process network, the ledger follows Algorithm 1, the
driver relays nothing, and a killed agent stops the run with a resumable error."""

import threading
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.federation import ClientError
from numpyro_fed.federation.base import block_spec
from numpyro_fed.federation.remote import RemoteFederation

from helpers import SENTINEL, holds_sentinel, save_client_rows

Y = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (30, 2))
X_LOGISTIC = jax.random.normal(jax.random.PRNGKey(1), (45, 2))
Y_LOGISTIC = (X_LOGISTIC @ jnp.array([1.0, -1.0]) + 0.5 * jax.random.normal(jax.random.PRNGKey(2), (45,)) > 0) * 1.0
PATH = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]])  # agents 0 - 1 - 2


def gaussian_model(y):
    mu = numpyro.sample("mu", dist.Normal(0, 10).expand([2]).to_event(1))
    with nf.federated_plate("data", y.shape[0], clients=3):
        numpyro.sample("y", dist.Normal(mu, 1).to_event(1), obs=y)


def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 3).expand([2]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=3):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def _run(federation, model, args, *, topology="ring", num_samples=12, num_chains=2, num_warmup=0, sampler=nf.DADMMS):
    mcmc = MCMC(
        sampler(model, topology=topology, federation=federation),
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=num_chains,
        chain_method="vectorized",
        progress_bar=False,
    )
    if federation is None:
        mcmc.run(jax.random.PRNGKey(1), *args)
    else:
        with federation.guard():
            mcmc.run(jax.random.PRNGKey(1), *args)
    return mcmc


@pytest.mark.parametrize(
    "sampler, model, args, topology",
    [
        (nf.DADMMS, gaussian_model, (Y,), "ring"),  # closed-form proximal steps
        (nf.DADMMS, logistic_model, (X_LOGISTIC, Y_LOGISTIC), PATH),  # Newton's proximal steps, a path
        (nf.DSGHMC, gaussian_model, (Y,), "ring"),  # a gradient baseline: iterate and momentum
    ],
)
def test_ray_agents_agree_with_the_in_process_network(ray_session, sampler, model, args, topology):
    local = _run(None, model, args, topology=topology, sampler=sampler)
    with nf.RayFederation(timeout=60.0) as federation:
        remote = _run(federation, model, args, topology=topology, sampler=sampler)
    # same per-agent keys and the same functions, compiled for (chains, agents) in process and
    # for (chains,) on each actor: XLA may fuse differently (seen: 1 ulp at the 5th iteration),
    # so the draws of every agent agree to round-off, far inside Monte Carlo error
    for site, value in sampler.agent_draws(local, group_by_chain=True).items():
        np.testing.assert_allclose(
            np.asarray(sampler.agent_draws(remote, group_by_chain=True)[site]),
            np.asarray(value),
            rtol=1e-11,
            atol=1e-13,
        )
    extra_local, extra_remote = local.get_extra_fields(), remote.get_extra_fields()
    for name in ("info.converged", "sent.messages", "sent.bytes"):
        if name in extra_local:
            np.testing.assert_array_equal(np.asarray(extra_remote[name]), np.asarray(extra_local[name]))
    for name in ("info.primal_residual", "info.dual_residual"):
        if name in extra_local:
            np.testing.assert_allclose(np.asarray(extra_remote[name]), np.asarray(extra_local[name]), rtol=1e-9)


def test_ledger_follows_algorithm_1_and_the_driver_relays_nothing(ray_session):
    chains, samples, d = 2, 12, 2
    local = _run(None, gaussian_model, (Y,), topology=PATH, num_samples=samples, num_chains=chains)
    with nf.RayFederation(timeout=60.0) as federation:
        remote = _run(federation, gaussian_model, (Y,), topology=PATH, num_samples=samples, num_chains=chains)
        deliveries = [jax.device_get(ray_session.get(a.deliveries.remote())) for a in federation.actors]
        summary = federation.ledger.summary()
    degrees = PATH.sum(1)
    # the sampler's own count (sample_stats): per chain, each agent sends its iterate (d floats)
    # to each neighbor once to start and once per iteration, in both networks
    stats = nf.DADMMS(gaussian_model).sample_stats(local.get_extra_fields(group_by_chain=True))
    messages, nbytes = stats["messages_to_peer"][0], stats["bytes_to_peer"][0]  # (chain, draw, agent)
    assert messages.shape == (chains, samples, 3)
    np.testing.assert_array_equal(messages[:, -1], [(samples + 1) * degrees] * chains)
    np.testing.assert_array_equal(nbytes[:, -1], [(samples + 1) * degrees * d * 8] * chains)
    np.testing.assert_array_equal(np.diff(messages, axis=1), np.broadcast_to(degrees, (chains, samples - 1, 3)))
    np.testing.assert_array_equal(
        np.asarray(remote.get_extra_fields()["sent.bytes"]), np.asarray(local.get_extra_fields()["sent.bytes"])
    )
    # Ray's ledger, counted from the payloads: every round an agent ran (the agents may run a
    # few iterations ahead of the sampler) carried one message of d floats per neighbor and chain
    rounds = summary["DADMMS/iterate/rounds"]
    assert np.all(rounds >= samples) and np.all(rounds == rounds[0])
    np.testing.assert_array_equal(summary["DADMMS/iterate/messages_to_peer"], rounds * degrees * chains)
    np.testing.assert_array_equal(summary["DADMMS/iterate/bytes_to_peer"], rounds * degrees * chains * d * 8)
    np.testing.assert_array_equal(summary["DADMMS/start/messages_to_peer"], degrees * chains)
    # the sampler's ledger (the same on every backend) is Ray's, counted from the payloads
    assert rounds[0] == samples  # here the agents ran no iteration ahead (chunks of 4 and 8)
    for counted in (nf.message_ledger(local), nf.message_ledger(remote)):
        for entry in ("DADMMS/start", "DADMMS/iterate"):
            for what in ("messages_to_peer", "bytes_to_peer", "rounds"):
                np.testing.assert_array_equal(counted[f"{entry}/{what}"], summary[f"{entry}/{what}"])
    # what the agents received is exactly what their neighbors sent: nothing from anyone else
    for m, got in enumerate(deliveries):
        assert set(got) == set(np.flatnonzero(PATH[m]).tolist())
        assert sum(got.values()) == (1 + rounds[m]) * degrees[m]  # one per neighbor and round (all chains)
    # the driver sent each agent its own state once (x_i, p_i and a key per chain), nothing else
    np.testing.assert_array_equal(summary["messages_to_client"], [chains] * 3)
    np.testing.assert_array_equal(summary["bytes_to_client"], [chains * (2 * d * 8 + 8)] * 3)
    assert set(k.split("/")[0] for k in summary if "/" in k) == {"DADMMS"}


def test_a_killed_agent_stops_the_run_naming_it_and_the_run_resumes(ray_session):
    timeout, samples = 10.0, 4000
    federation = nf.RayFederation(timeout=timeout)
    mcmc = MCMC(
        nf.DADMMS(gaussian_model, federation=federation),
        num_warmup=0,
        num_samples=samples,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    killed = {}

    def kill_agent_1():
        while not (federation.started and federation.ledger.rounds().max() > 20):
            time.sleep(0.05)
        killed["at"] = time.monotonic()
        ray_session.kill(federation.actors[1])

    killer = threading.Thread(target=kill_agent_1, daemon=True)
    killer.start()
    try:
        with pytest.raises(ClientError, match="agent 1 died") as caught:
            with federation.guard():
                mcmc.run(jax.random.PRNGKey(1), Y)
        waited = time.monotonic() - killed["at"]
        error = caught.value
        assert error.clients == (1,)
        assert waited < timeout, waited
        # what was computed before the fault: the state at the last completed iteration, and every
        # agent's draws up to it
        state, draws = error.state, error.draws
        done = error.iteration
        assert 0 < done < samples and state.i.tolist() == [done, done]
        assert draws["mu"].shape == (2, done, 3, 2)
        # resume: the dead agent's actor is replaced and the run continues where it stopped, with
        # the numbers an uninterrupted run draws (to round-off)
        mcmc.post_warmup_state = state
        mcmc.num_samples = 5
        with federation.guard():
            mcmc.run(state.rng_key, Y)
        assert mcmc.last_state.i.tolist() == [done + 5, done + 5]
    finally:
        federation.close()
    reference = MCMC(
        nf.DADMMS(gaussian_model),
        num_warmup=0,
        num_samples=done + 5,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    reference.run(jax.random.PRNGKey(1), Y)
    expected = np.asarray(nf.DADMMS.agent_draws(reference, group_by_chain=True)["mu"])
    np.testing.assert_allclose(np.asarray(draws["mu"]), expected[:, :done], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        np.asarray(nf.DADMMS.agent_draws(mcmc, group_by_chain=True)["mu"]), expected[:, done:], rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("build", ["dadmms_newton", "dadmms_quadratic", "dsgld"])
def test_what_an_agent_receives_holds_its_own_rows_only(build):
    # what RayNetwork sends actor m: the program's functions and agent m's slice of its data
    import cloudpickle

    from numpyro_fed.infer import admm

    potentials = admm.agent_potentials(nf.split_potential(gaussian_model, (Y,)))
    topology = admm.make_topology("ring", 3)
    if build == "dsgld":
        program = admm.build_dsgld_program(potentials, admm.metropolis_weights(topology), 0.01)
    else:
        quadratic = admm.quadratic_potentials(potentials, jnp.zeros(2)) if build == "dadmms_quadratic" else None
        program = admm.build_program(potentials, topology.degrees, 5.0, quadratic=quadratic)
    rows = np.asarray(Y).reshape(3, 10, 2)
    for m in range(3):
        sent = cloudpickle.dumps(program._replace(local=jax.tree.map(lambda a: np.asarray(a[m]), program.local)))
        for k in range(3):
            held = [rows[k, r].tobytes() in sent for r in range(10)]
            if k == m and build != "dadmms_quadratic":  # the closed form holds factors, not rows
                assert all(held)
            elif k != m:
                assert not any(held), (m, k)


@jax.tree_util.register_pytree_node_class
class HubAndSpoke(RemoteFederation):
    """An engine whose clients talk to the server only (as Flower's): it runs no agents."""

    def start_clients(self, program):
        return [block_spec(block) for block in program.blocks]

    def send_calls(self, name, calls):
        raise AssertionError("no call reaches the clients")


@pytest.mark.parametrize("loader", [None, lambda m: (np.asarray(Y[10 * m : 10 * (m + 1)]),)])
def test_a_backend_that_runs_no_agents_refuses_from_the_seam(loader):
    federation = HubAndSpoke() if loader is None else HubAndSpoke(loader=loader, num_clients=3)
    assert not federation.runs_agents and nf.InProcess.runs_agents and nf.RayFederation.runs_agents
    mcmc = MCMC(nf.DADMMS(gaussian_model, federation=federation), num_warmup=0, num_samples=2, progress_bar=False)
    with pytest.raises(TypeError, match="HubAndSpoke cannot run decentralized agents"):
        mcmc.run(jax.random.PRNGKey(0), *(() if loader else (Y,)))


# -- deployment: each agent loads its own rows where it lives ----------------------------------

ROWS = 10  # per client


def deployment_rows():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(3 * ROWS, 2))
    X[ROWS, 0] = SENTINEL  # client 1's first row
    y = (X @ np.array([1.0, -1.0]) + rng.normal(size=3 * ROWS) > 0) * 1.0
    return X, y


def linear_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 3).expand([2]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=3):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def save_per_agent(tmp_path):
    """Each client's rows in its own files, and a loader that reads them and records the pid
    of the process it runs in."""
    return save_client_rows(tmp_path, [0, ROWS, 2 * ROWS, 3 * ROWS], *deployment_rows(), record_pids=True)


def _deployed_run(federation, sampler, model, *, num_samples=10, **kwargs):
    mcmc = MCMC(
        sampler(model, federation=federation, **kwargs),
        num_warmup=3,
        num_samples=num_samples,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    with federation.guard() if hasattr(federation, "guard") else contextlib_null():
        mcmc.run(jax.random.PRNGKey(4))  # no data arguments: the loaders give the rows
    return mcmc


def contextlib_null():
    import contextlib

    return contextlib.nullcontext()


def _simulated_run(sampler, model, *, num_samples=10, **kwargs):
    mcmc = MCMC(
        sampler(model, **kwargs),
        num_warmup=3,
        num_samples=num_samples,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(4), *deployment_rows())
    return mcmc


@pytest.mark.parametrize(
    "sampler, model",
    [
        (nf.DADMMS, logistic_model),  # Newton's proximal steps
        (nf.DADMMS, linear_model),  # closed form
        pytest.param(nf.ADMM, linear_model, marks=pytest.mark.slow),
        (nf.DSGLD, logistic_model),
        pytest.param(nf.DSGHMC, linear_model, marks=pytest.mark.slow),
        pytest.param(nf.DULA, logistic_model, marks=pytest.mark.slow),
    ],
)
def test_deployment_in_process_draws_the_simulation_s_numbers(tmp_path, sampler, model):
    simulated = _simulated_run(sampler, model)
    deployed = _deployed_run(nf.InProcess(loader=save_per_agent(tmp_path), num_clients=3), sampler, model)
    for site, value in sampler.agent_draws(simulated, group_by_chain=True).items():
        np.testing.assert_array_equal(
            np.asarray(sampler.agent_draws(deployed, group_by_chain=True)[site]), np.asarray(value)
        )
    assert deployed.sampler.federated_potential.deployed
    assert deployed.sampler.solver_used == simulated.sampler.solver_used if sampler is nf.DADMMS else True


def _check_ray_deployment(ray_session, tmp_path, sampler, model, **kwargs):
    import os

    simulated = _simulated_run(sampler, model, **kwargs)
    load = save_per_agent(tmp_path)
    federation = nf.RayFederation(loader=load, num_clients=3, timeout=60.0)
    try:
        deployed = _deployed_run(federation, sampler, model, **kwargs)
        kernel = deployed.sampler
        ledger = federation.ledger.summary()
        names = federation.ledger.names
        # the driver holds no row: not the sampler, its potential, the agents' programs, the
        # federation's program, the draws nor the ArviZ object
        assert holds_sentinel(deployment_rows())  # the check sees rows when they are there
        assert not holds_sentinel(
            kernel,
            kernel.federated_potential,
            kernel.agent_potentials,
            federation.program,
            deployed.get_samples(),
            deployed.get_extra_fields(),
            nf.to_inference_data(deployed),
        )
        # the check of the draws (Stein's identity) asks the agents for their gradients
        if kernel.samples_posterior:
            kernel.check_spread(deployed)
            assert f"{type(kernel).__name__}/diagnostics" in federation.ledger.names
    finally:
        federation.close()
    # the loaders ran on the workers only
    pids = {int(p) for p in open(tmp_path / "pids").read().split()}
    assert pids and os.getpid() not in pids
    for site, value in sampler.agent_draws(simulated, group_by_chain=True).items():
        np.testing.assert_allclose(
            np.asarray(sampler.agent_draws(deployed, group_by_chain=True)[site]),
            np.asarray(value),
            rtol=1e-9,
            atol=1e-11,
        )
    return kernel, ledger, names


def test_deployment_on_ray_agents_load_their_own_rows_and_the_driver_holds_none(ray_session, tmp_path):
    kernel, ledger, names = _check_ray_deployment(ray_session, tmp_path, nf.DADMMS, logistic_model)
    # set-up: each agent told whether its potential is quadratic (one boolean), nothing else
    assert kernel.solver_used == "newton"
    np.testing.assert_array_equal(ledger["DADMMS/quadratic/messages_from_client"], [1, 1, 1])
    np.testing.assert_array_equal(ledger["DADMMS/quadratic/bytes_from_client"], [1, 1, 1])
    assert {"DADMMS/quadratic", "DADMMS/start", "DADMMS/iterate", "DADMMS/state"} <= set(names)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampler, model",
    [
        (nf.DADMMS, linear_model),  # each agent factors its own quadratic where it lives
        (nf.ADMM, linear_model),
        (nf.DSGLD, logistic_model),
        (nf.DSGHMC, linear_model),
        (nf.DULA, logistic_model),
    ],
)
def test_deployment_on_ray_every_decentralized_sampler(ray_session, tmp_path, sampler, model):
    kernel, ledger, names = _check_ray_deployment(ray_session, tmp_path, sampler, model)
    if sampler in (nf.DSGLD, nf.DSGHMC, nf.DULA):  # the step-size check: one curvature per agent
        np.testing.assert_array_equal(ledger[f"{sampler.__name__}/curvature/messages_from_client"], [1, 1, 1])
    else:
        assert kernel.solver_used == "quadratic"
