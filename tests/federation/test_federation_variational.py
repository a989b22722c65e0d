"""DP-PVI and DSVGD through the federation seam: the message ledger matches what each
algorithm sends, a run stopped by a client's fault resumes to the uninterrupted run's
answer, and (on a local Ray) the clients as separate workers give the in-process answer."""

import contextlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.federation import ClientError, InProcess
from numpyro_fed.infer import RunCheckpoint

from helpers import SENTINEL, holds_sentinel, holds_value, save_client_rows
from runs import assert_same_run

# Short runs: they check what crosses and that answers agree, not the fits (whose
# convergence warnings they would trigger).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

M, D, ROWS = 3, 2, 90
F64 = 8  # bytes of a float64 (the tests run in float64)
KEY = 8  # a threefry key: two uint32


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=M):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(ROWS, D))
    y = (X @ np.array([1.0, -1.0]) + rng.logistic(size=ROWS) > 0).astype(float)
    return jnp.asarray(X), jnp.asarray(y)


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
@pytest.mark.parametrize("dp", [None, "virtual"])
def test_dppvi_ledger_counts_what_the_protocol_sends(data, schedule, dp):
    rounds, shards, draws = 2, 3, 4
    kwargs = dict(dp="virtual", noise_multiplier=1.0, num_shards=shards) if dp else {}
    pvi = nf.DPPVI(model, schedule=schedule, num_local_steps=5, num_mc_samples=draws, progress_bar=False, **kwargs)
    result = pvi.run(jax.random.PRNGKey(0), rounds, *data)
    ledger = result.ledger
    # (eta1, eta2) of q: full-rank by default without privacy (d <= 100), diagonal when private
    natural = (D + (D * D if dp is None else D)) * F64
    # per round and client: q down, Delta t_m up (the paper's messages), whatever the
    # variant: the client's factor (dp="virtual": its K virtual factors) stays with it; plus,
    # down, the loss's draws of q, the client's key and which of the D coordinates of its last
    # update the server applied (booleans), and up three diagnostics (clipped, residual, its
    # term of the loss): one message each way per round
    loss_draws = draws * D * F64
    np.testing.assert_array_equal(ledger["update/messages_to_client"], [rounds] * M)
    np.testing.assert_array_equal(ledger["update/rounds"], [rounds] * M)
    np.testing.assert_array_equal(ledger["update/bytes_to_client"], [rounds * (natural + loss_draws + KEY + D)] * M)
    np.testing.assert_array_equal(ledger["update/bytes_from_client"], [rounds * (natural + 3 * F64)] * M)
    assert not [k for k in ledger if "state" in k]  # no client state crossed, none is counted
    # the clients keep their factors (in process: in result.state.clients): the virtual
    # factors sum to the factor the server knows from the changes it received
    factors = nf.infer.pvi.client_factors(result.state)
    total = factors.eta1.sum(1) if dp else factors.eta1
    np.testing.assert_allclose(total, result.state.factors.eta1, rtol=1e-10, atol=1e-12)
    # the loss of the final q, a diagnostic: one call after the rounds, draws of q down, one number up
    np.testing.assert_array_equal(ledger["expected_log_lik/messages_to_client"], [1] * M)
    np.testing.assert_array_equal(ledger["expected_log_lik/bytes_to_client"], [loss_draws] * M)
    np.testing.assert_array_equal(ledger["expected_log_lik/bytes_from_client"], [F64] * M)
    stats = nf.to_inference_data(result).sample_stats
    assert stats["ledger.update.bytes_to_client"].dims == ("client",)
    np.testing.assert_array_equal(stats["ledger.update.bytes_to_client"].values, ledger["update/bytes_to_client"])


def test_gaussian_pvi_ledger_counts_the_scheduled_client_only(data):
    pvi = nf.GaussianPVI(model, num_local_steps=5, client_order=[0, 2, 2], progress_bar=False)
    result = pvi.run(jax.random.PRNGKey(0), 3, *data)
    natural = 2 * D * F64
    np.testing.assert_array_equal(result.ledger["update/rounds"], [1, 0, 2])
    # down: q, the round's key and which coordinates of the client's last update were
    # applied; up: the change of its factor (which it keeps) and two diagnostics
    np.testing.assert_array_equal(result.ledger["update/bytes_to_client"], np.array([1, 0, 2]) * (natural + KEY + D))
    np.testing.assert_array_equal(result.ledger["update/bytes_from_client"], np.array([1, 0, 2]) * (natural + 2 * F64))


def test_dsvgd_ledger_counts_particles_between_server_and_scheduled_client(data):
    n, rounds = 6, 4
    dsvgd = nf.DSVGD(model, num_particles=n, num_local_steps=5, num_distill_steps=5, progress_bar=False)
    result = dsvgd.run(jax.random.PRNGKey(0), rounds, *data)
    particles = n * D * F64
    visits = np.bincount(result.metrics["client"], minlength=M)  # round robin: 2, 1, 1
    np.testing.assert_array_equal(visits, [2, 1, 1])
    ledger = result.ledger
    np.testing.assert_array_equal(ledger["update/rounds"], visits)
    # down: the global particles and whether q is still the prior; up: the new global
    # particles (Algorithm 1). The local particles stay with the client.
    np.testing.assert_array_equal(ledger["update/bytes_to_client"], visits * (particles + 1))
    np.testing.assert_array_equal(ledger["update/bytes_from_client"], visits * particles)
    assert not [k for k in ledger if "state" in k]
    # in process, the clients' local particles are in result.state.clients (never sent)
    local = result.state.clients.values.local_particles
    assert local.shape == (M, n, D)
    np.testing.assert_array_equal(result.state.clients.version, visits)


def test_pdsvgd_ledger_counts_local_particles_up(data):
    n = 5
    pdsvgd = nf.PDSVGD(
        model, num_particles=n, clients_per_round=2, num_local_steps=5, num_distill_steps=5, progress_bar=False
    )
    result = pdsvgd.run(jax.random.PRNGKey(0), 3, *data)
    visits = np.bincount(np.ravel(result.metrics["client"]), minlength=M)
    assert visits.sum() == 6
    particles = n * D * F64
    # down: the server's particles and whether q is the prior; up: the client's new local
    # particles (Algorithm 5), which it also keeps
    np.testing.assert_array_equal(result.ledger["update/rounds"], visits)
    np.testing.assert_array_equal(result.ledger["update/bytes_from_client"], visits * particles)
    np.testing.assert_array_equal(result.ledger["update/bytes_to_client"], visits * (particles + 1))
    state = result.state
    visited = np.flatnonzero(visits)
    np.testing.assert_array_equal(state.uploads[visited], state.clients.values.local_particles[visited])


def test_udsvgd_ledger_counts_the_global_particles_and_the_round(data):
    n, rounds = 5, 4
    udsvgd = nf.UDSVGD(model, num_particles=n, num_local_steps=5, progress_bar=False)
    result = udsvgd.run(jax.random.PRNGKey(0), rounds, *data)
    visits = np.bincount(result.metrics["client"], minlength=M)
    particles = n * D * F64
    # down: the global particles and the round's index; up: the new global particles (the
    # client's buffer of iterates stays with it)
    np.testing.assert_array_equal(result.ledger["update/bytes_to_client"], visits * (particles + 4))
    np.testing.assert_array_equal(result.ledger["update/bytes_from_client"], visits * particles)
    # each client's buffer holds the iterates before and after its own rounds only
    buffers = result.state.clients.values
    history = np.asarray(result.metrics["particles"])
    for j, client in enumerate(result.metrics["client"]):
        np.testing.assert_array_equal(buffers.history[client, j + 1], history[j])
    assert buffers.mine.sum(axis=1).tolist() == visits.tolist()


#: the guard entry at which a run's first round fails (the first entry is its set-up's)
FIRST_ROUND = 2


@jax.tree_util.register_pytree_node_class
class FailingInProcess(InProcess):
    """In-process clients whose ``fail_at``-th round fails as a dead worker's would."""

    def __init__(self, fail_at):
        super().__init__()
        self.fail_at, self.entered = fail_at, 0

    @contextlib.contextmanager
    def guard(self):
        self.entered += 1
        if self.entered == self.fail_at:
            raise ClientError("client 1 stopped answering", clients=[1], call="update")
        yield


@pytest.mark.parametrize("method", ["dppvi", "dsvgd"])
def test_a_client_fault_stops_the_run_and_the_checkpoint_resumes_it(data, method):
    def make(federation=None):
        if method == "dppvi":
            return nf.DPPVI(
                model,
                dp="dpsgd",
                noise_multiplier=1.0,
                sampling="poisson",
                sampling_rate=0.5,
                clip_norm=1.0,
                num_local_steps=5,
                progress_bar=False,
                federation=federation,
            )
        return nf.DSVGD(
            model, num_particles=5, num_local_steps=5, num_distill_steps=5, progress_bar=False, federation=federation
        )

    key, rounds = jax.random.PRNGKey(1), 4
    full = make().run(key, rounds, *data)
    with pytest.raises(ClientError, match="client 1") as info:
        make(FailingInProcess(fail_at=5)).run(key, rounds, *data)
    checkpoint, partial = info.value.state, info.value.result
    assert isinstance(checkpoint, RunCheckpoint)
    assert 0 < checkpoint.rounds_done < rounds
    assert partial.metrics["wall_time"].shape == (checkpoint.rounds_done,)
    # the rounds done before the fault are those of the uninterrupted run
    done = checkpoint.rounds_done
    if method == "dsvgd":
        np.testing.assert_array_equal(partial.metrics["move"], full.metrics["move"][:done])
    else:  # the loss after the last round done would have come with the failed round's updates
        np.testing.assert_array_equal(partial.metrics["loss"][:-1], full.metrics["loss"][: done - 1])
        assert np.isnan(partial.metrics["loss"][-1])
        np.testing.assert_array_equal(partial.metrics["loc"], full.metrics["loc"][:done])
    resumed = make().run(key, rounds, *data, init_state=checkpoint)
    for name, value in full.metrics.items():
        if name != "wall_time":
            np.testing.assert_array_equal(resumed.metrics[name], value, err_msg=name)
    for leaf_full, leaf_resumed in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(leaf_resumed, leaf_full)
    for name, value in full.ledger.items():
        np.testing.assert_array_equal(resumed.ledger[name], value, err_msg=name)
    with pytest.raises(ValueError, match="num_rounds"):
        make().run(key, rounds + 1, *data, init_state=checkpoint)


@pytest.mark.parametrize("name", ["DPPVI", "DSVGD"])
def test_a_fault_in_the_first_round_is_the_client_error(data, name):
    """A run whose clients fail before any round ends raises the ClientError naming them (its
    partial result has no loss to shift), not an error of the bookkeeping after it."""
    federation = FailingInProcess(fail_at=FIRST_ROUND)
    method = getattr(nf, name)(model, num_local_steps=5, progress_bar=False, federation=federation)
    with pytest.raises(ClientError, match="client 1") as info:
        method.run(jax.random.PRNGKey(1), 3, *data)
    assert info.value.state.rounds_done == 0


def test_federation_must_be_a_federation(data):
    with pytest.raises(TypeError, match="federation"):
        nf.DPPVI(model, federation="ray")


# -- on a local Ray: the clients as separate workers ---------------------------------------------

# The private cases compare a run on separate workers with the in-process one bit for bit, so
# they opt out of the clients' private randomness (by default a client mixes a seed of its own
# into its keys: tests/privacy/test_private_randomness.py), and their guarantee says so.
RAY_CASES = {
    "dppvi": lambda **kw: nf.DPPVI(model, schedule="synchronous", num_local_steps=5, progress_bar=False, **kw),
    "dppvi-dpsgd": lambda **kw: nf.DPPVI(
        model,
        dp="dpsgd",
        noise_multiplier=1.0,
        sampling="poisson",
        sampling_rate=0.5,
        clip_norm=1.0,
        num_local_steps=5,
        progress_bar=False,
        private_randomness=False,
        **kw,
    ),
    "dsvgd": lambda **kw: nf.DSVGD(
        model, num_particles=5, num_local_steps=5, num_distill_steps=5, progress_bar=False, **kw
    ),
    "dppvi-virtual": lambda **kw: nf.DPPVI(
        model,
        dp="virtual",
        noise_multiplier=1.0,
        num_shards=2,
        num_local_steps=5,
        progress_bar=False,
        private_randomness=False,
        **kw,
    ),
    "pdsvgd": lambda **kw: nf.PDSVGD(
        model,
        num_particles=5,
        clients_per_round=2,
        num_local_steps=5,
        num_distill_steps=5,
        batch_size=7,
        progress_bar=False,
        **kw,
    ),
    "udsvgd": lambda **kw: nf.UDSVGD(model, num_particles=5, num_local_steps=5, progress_bar=False, **kw),
    "gaussian_pvi": lambda **kw: nf.GaussianPVI(model, num_local_steps=5, progress_bar=False, **kw),
}


def kept_by_the_clients(state):
    """The bytes of each array a client keeps and the paper never sends: DSVGD's local
    particles and U-DSVGD's buffers (of the clients that ran), DP-PVI's virtual factors."""
    values = state.clients.values
    ran = np.flatnonzero(np.asarray(state.clients.version))
    if isinstance(values, nf.infer.stein.LocalState) and not hasattr(state, "uploads"):
        leaves = [values.local_particles[c] for c in ran]
    elif isinstance(values, nf.infer.stein.Buffer):
        leaves = [values.history[c] for c in ran]
    elif isinstance(values, nf.infer.pvi.ClientFactor) and values.factor.eta1.ndim == 3:
        leaves = [x[c] for c in ran for x in (values.factor.eta1, values.pending.eta1)]
    else:  # P-DSVGD's local particles are uploaded; PVI's factor is the sum of the changes sent
        leaves = []  # (PVI's client state is checked with a planted value instead, below)
    return [np.asarray(leaf).tobytes() for leaf in leaves]


STATE_SENTINEL = 0.0012345678901234567  # planted in client 1's own state only (a plausible value)


def holds_state_sentinel(*objects):
    return holds_value(STATE_SENTINEL, *objects)


def with_planted_client_state(state):
    """A PVI initial state whose client 1 keeps ``STATE_SENTINEL`` in its own factor (its
    first virtual factor with ``dp="virtual"``): a value of the client's state only, which no
    message carries (the server's record of the factors stays as it was)."""
    values = state.clients.values
    eta1 = values.factor.eta1
    eta1 = eta1.at[(1,) + (0,) * (eta1.ndim - 1)].set(STATE_SENTINEL)
    values = values._replace(factor=values.factor._replace(eta1=eta1))
    return state._replace(clients=state.clients._replace(values=values))


# in CI: DPPVI and DSVGD (one of each family); the other cases (DP-SGD is also run on Ray by
# the killed-worker test, the virtual factors by the deployment test) in make test-slow
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.slow)
        if c in ("pdsvgd", "udsvgd", "gaussian_pvi", "dppvi-virtual", "dppvi-dpsgd")
        else c
        for c in sorted(RAY_CASES)
    ],
)
def test_on_ray_the_run_is_the_in_process_run(ray_session, data, case):
    key = jax.random.PRNGKey(2)
    local = RAY_CASES[case]().run(key, 2, *data)
    with nf.RayFederation(timeout=60.0) as federation:
        on_ray = RAY_CASES[case](federation=federation).run(key, 2, *data)
    # the same run, and the same ledger: on Ray it is counted from the payloads the actors
    # received and sent, so they carried the protocol's messages and no client state
    # P-DSVGD's server state is made from the particles the clients upload: to round-off
    assert_same_run(on_ray, local, state_rtol=1e-12 if case == "pdsvgd" else 0.0)
    # nothing the driver holds after the run contains what the clients kept
    cloudpickle = pytest.importorskip("cloudpickle")
    held = cloudpickle.dumps((on_ray.state, on_ray.metrics, on_ray.ledger))
    secrets = kept_by_the_clients(local.state)
    assert secrets or case not in ("dsvgd", "udsvgd", "dppvi-virtual")
    assert not any(secret in held for secret in secrets)
    assert any(secret in cloudpickle.dumps(local.state) for secret in secrets) or not secrets  # the check can fail
    if case in ("dppvi", "dppvi-dpsgd", "dppvi-virtual", "gaussian_pvi"):
        # PVI's client state: a value planted in client 1's state before a round stays in the
        # client's state (the in-process run keeps it in this process, so the check can fail)
        # and never reaches the driver when the clients are workers
        planted = with_planted_client_state(RAY_CASES[case]().init(key, *data))
        local = RAY_CASES[case]().run(key, 1, *data, init_state=planted)
        assert holds_state_sentinel(local.state)
        with nf.RayFederation(timeout=60.0) as federation:
            on_ray = RAY_CASES[case](federation=federation).run(key, 1, *data, init_state=planted)
            assert_same_run(on_ray, local)
            assert not holds_state_sentinel(
                on_ray.state, on_ray.metrics, on_ray.ledger, federation.ledger, federation.program
            )


@pytest.mark.parametrize("case", ["dppvi-dpsgd", pytest.param("dsvgd", marks=pytest.mark.slow)])
def test_on_ray_a_killed_worker_stops_the_run_and_it_resumes(ray_session, data, case):
    key, rounds = jax.random.PRNGKey(3), 3
    local = RAY_CASES[case]().run(key, rounds, *data)
    # a killed actor is reported at once; the timeout only bounds the first call, which
    # compiles on the worker (tens of seconds on a loaded machine)
    federation = nf.RayFederation(timeout=60.0)
    method = RAY_CASES[case](federation=federation)
    record = method.record

    def record_then_kill(state, info):  # between rounds 1 and 2, client 1's worker dies
        out = record(state, info)
        if int(state.round) == 1:
            ray_session.kill(federation.actors[1])
        return out

    method.record = record_then_kill
    try:
        with pytest.raises(ClientError, match="client 1") as info:
            method.run(key, rounds, *data)
        assert info.value.clients == (1,)
        checkpoint = info.value.state
        assert checkpoint.rounds_done == 1
        assert info.value.result.metrics["wall_time"].shape == (1,)
        method.record = record
        resumed = method.run(key, rounds, *data, init_state=checkpoint)  # fresh workers
    finally:
        federation.close()
    assert_same_run(resumed, local, interrupted=True)


# -- deployment: each client loads its own rows --------------------------------------------------


@pytest.fixture(scope="module")
def planted(data):
    X, y = (np.array(a) for a in data)
    X[ROWS // M, 0] = SENTINEL  # client 1's first row
    return X, y


def save_per_client(folder, X, y):
    """Each client's rows in its own files (in the order of the simulation's partition), and a
    loader that reads client m's and records the process that read them."""
    size = ROWS // M
    return save_client_rows(folder, range(0, ROWS + 1, size), X, y, record_pids=True)


DEPLOY_CASES = {
    "dppvi": lambda **kw: nf.DPPVI(model, num_local_steps=5, progress_bar=False, **kw),
    "dppvi-dpsgd": RAY_CASES["dppvi-dpsgd"],
    "dppvi-virtual": lambda **kw: nf.DPPVI(
        model,
        dp="virtual",
        schedule="synchronous",
        noise_multiplier=1.0,
        num_shards=2,
        trusted_aggregator=True,
        num_local_steps=5,
        progress_bar=False,
        private_randomness=False,
        **kw,
    ),
    "bcm": lambda **kw: nf.BCM(
        model,
        noise_multiplier=1.0,
        sampling="poisson",
        sampling_rate=0.5,
        clip_norm=1.0,
        num_local_steps=5,
        progress_bar=False,
        private_randomness=False,
        **kw,
    ),
    "gaussian_pvi": lambda **kw: nf.GaussianPVI(model, num_local_steps=5, progress_bar=False, **kw),
    "dsvgd": RAY_CASES["dsvgd"],
    "pdsvgd": lambda **kw: nf.PDSVGD(
        model, num_particles=5, clients_per_round=2, num_local_steps=5, num_distill_steps=5, progress_bar=False, **kw
    ),
    "udsvgd": lambda **kw: nf.UDSVGD(model, num_particles=5, num_local_steps=5, batch_size=7, progress_bar=False, **kw),
}


def assert_same_result(a, b):
    assert jax.tree.structure(a.state) == jax.tree.structure(b.state)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
        np.testing.assert_array_equal(x, y)
    assert set(a.metrics) == set(b.metrics)
    for name, value in b.metrics.items():
        if name != "wall_time":
            np.testing.assert_array_equal(a.metrics[name], value, err_msg=name)
    assert set(a.ledger) == set(b.ledger)
    for name, value in b.ledger.items():
        np.testing.assert_array_equal(a.ledger[name], value, err_msg=name)


@pytest.mark.parametrize("case", sorted(DEPLOY_CASES))
def test_deployment_in_process_is_the_simulation(planted, tmp_path, case):
    # the clients load their own rows (InProcess(loader=...)): the same run as the driver
    # cutting the pooled rows, bit for bit, with the same ledger; the driver's potential holds
    # no row
    key, rounds = jax.random.PRNGKey(4), 1 if case == "bcm" else 2
    simulated = DEPLOY_CASES[case]().run(key, rounds, *planted)
    federation = InProcess(loader=save_per_client(tmp_path, *planted), num_clients=M)
    method = DEPLOY_CASES[case](federation=federation)
    deployed = method.run(key, rounds)
    assert method.federated_potential.deployed
    assert_same_result(deployed, simulated)
    assert not holds_sentinel(method.federated_potential, deployed.state, deployed.metrics)
    idata = nf.to_inference_data(deployed)
    np.testing.assert_array_equal(idata.sample_stats["ledger.update.rounds"].values, deployed.ledger["update/rounds"])
    assert (deployed.privacy is not None) == ("privacy_epsilon" in idata.attrs)
    with pytest.raises(ValueError, match="without data arguments"):
        DEPLOY_CASES[case](federation=InProcess(loader=save_per_client(tmp_path, *planted), num_clients=M)).run(
            key, rounds, *planted
        )


@pytest.mark.parametrize("baseline", ["SVGD", "FedAvg", "DistributedSGLD", "GlobalVI"])
def test_baselines_that_pool_the_rows_refuse_deployment(planted, tmp_path, baseline):
    federation = InProcess(loader=save_per_client(tmp_path, *planted), num_clients=M)
    method = getattr(nf, baseline)(
        model,
        progress_bar=False,
        federation=federation,
        **({"noise_multiplier": 1.0} if baseline == "GlobalVI" else {}),
    )
    with pytest.raises(ValueError, match=f"{baseline} .*cannot run in deployment.*simulation"):
        method.run(jax.random.PRNGKey(0), 1)


@pytest.mark.parametrize("case", ["dppvi-virtual", "dsvgd", pytest.param("dppvi", marks=pytest.mark.slow)])
def test_deployment_on_ray_the_driver_holds_no_row(ray_session, planted, tmp_path, case):
    import os

    key, rounds = jax.random.PRNGKey(5), 2
    load = save_per_client(tmp_path, *planted)
    local = DEPLOY_CASES[case](federation=InProcess(loader=load, num_clients=M)).run(key, rounds)
    (tmp_path / "pids").unlink()
    with nf.RayFederation(timeout=120.0, loader=load, num_clients=M) as federation:
        method = DEPLOY_CASES[case](federation=federation)
        result = method.run(key, rounds)
        # the server's state bit for bit; the loss (each client's term compiled alone on its
        # worker rather than vmapped) and Stein's diagnostics to round-off; the same ledger
        assert_same_run(
            result, local._replace(metrics={k: v for k, v in local.metrics.items() if not k.startswith("stein")})
        )
        for name in ("stein_mean", "stein_scale"):
            if name in local.metrics:
                np.testing.assert_allclose(result.metrics[name], local.metrics[name], rtol=1e-9, atol=1e-12)
        idata = nf.to_inference_data(result)
        assert not holds_sentinel(
            method.federated_potential, federation.program, result.state, result.metrics, result.ledger, idata.to_dict()
        )
    pids = {int(p) for p in (tmp_path / "pids").read_text().split()}
    assert pids and os.getpid() not in pids  # only the workers read the clients' files
