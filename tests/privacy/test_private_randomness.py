"""Client-private randomness: wherever the clients are parties apart from the server (an
engine, or a deployment in which each client loads its own rows), a private run's clients mix
a seed of their own into the keys of their noise and batches, so the server, which chose the
keys, cannot replay the noise; in-process simulation stays reproducible, and a deployed run is
reproducible when it opts out by name (its guarantee then says it does not hold against the
server)."""

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.federation import ClientProgram, InProcess
from numpyro_fed.privacy import PrivateSeed, clients_are_separate, private_program

from helpers import save_client_rows
from models import PRIVATE_CLIENTS, PRIVATE_ROWS, private_logistic, private_logistic_data

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # short runs: fits are not the point

M, ROWS = PRIVATE_CLIENTS, PRIVATE_ROWS


model = private_logistic


@pytest.fixture(scope="module")
def data():
    return private_logistic_data()


@pytest.fixture
def loader(data, tmp_path):
    return save_client_rows(tmp_path, range(0, ROWS + 1, ROWS // M), *data)


VARIANTS = {
    "dpsgd": dict(dp="dpsgd", noise_multiplier=1.0, sampling_rate=0.5, clip_norm=1.0),
    "dpsgd-auto-clip": dict(dp="dpsgd", noise_multiplier=1.0, sampling_rate=0.5),
    "local_avg": dict(dp="local_avg", noise_multiplier=1.0, num_shards=2),
    "virtual": dict(dp="virtual", noise_multiplier=1.0, num_shards=2),
}


def dppvi(variant, federation=None, **kw):
    return nf.DPPVI(model, num_local_steps=5, progress_bar=False, federation=federation, **VARIANTS[variant], **kw)


def q_of(result):
    return np.asarray(result.state.q.eta1), np.asarray(result.state.q.eta2)


def same_q(a, b):
    return all(np.array_equal(x, y) for x, y in zip(q_of(a), q_of(b)))


# DP-SGD with a given clip norm and local averaging in every run of the tests; the automatic
# clip norm (its key follows one more argument) and virtual clients in make test-slow
@pytest.mark.parametrize(
    "variant", [v if v in ("dpsgd", "local_avg") else pytest.param(v, marks=pytest.mark.slow) for v in sorted(VARIANTS)]
)
def test_deployed_private_runs_draw_noise_the_server_cannot_replay(data, loader, variant):
    key = jax.random.PRNGKey(0)
    simulated = dppvi(variant).run(key, 2, *data)  # in process: reproducible (below), and says so
    assert not simulated.privacy.client_private_randomness
    assert "does not hold against the server" in str(simulated.privacy)
    first = dppvi(variant, InProcess(loader=loader, num_clients=M)).run(key, 2)
    second = dppvi(variant, InProcess(loader=loader, num_clients=M)).run(key, 2)
    assert first.privacy.client_private_randomness and "client-private" in str(first.privacy)
    assert "does not hold against the server" not in str(first.privacy)
    # the same key, other noise: neither the second run nor the server's replay (the same
    # key on the same rows in this process) reproduces the clients' draws
    assert not same_q(first, second)
    assert not same_q(first, simulated)
    assert np.isfinite(q_of(first)[0]).all()
    # what crossed is the same protocol: the seed never leaves the client
    for name, value in simulated.ledger.items():
        np.testing.assert_array_equal(first.ledger[name], value, err_msg=name)
    # by name, a deployed run is the simulation bit for bit, and its guarantee says what it lost
    opted_out = dppvi(variant, InProcess(loader=loader, num_clients=M), private_randomness=False).run(key, 2)
    assert same_q(opted_out, simulated)
    assert not opted_out.privacy.client_private_randomness
    assert "does not hold against the server" in str(opted_out.privacy)


def test_non_private_deployed_runs_stay_reproducible(data, loader):
    key = jax.random.PRNGKey(1)
    simulated = nf.DPPVI(model, num_local_steps=5, progress_bar=False).run(key, 2, *data)
    federation = InProcess(loader=loader, num_clients=M)
    deployed = nf.DPPVI(model, num_local_steps=5, progress_bar=False, federation=federation).run(key, 2)
    assert deployed.privacy is None and same_q(deployed, simulated)


def test_the_mechanism_folds_a_seed_drawn_where_the_block_is_built():
    """One mechanism for every algorithm: a call named with the position of its key gets the
    client's seed folded into it; the others see the client's own block."""

    def draw(block, scale, key):
        return block.sum() + scale * jax.random.normal(key)

    functions, stateful = private_program(
        {"draw": draw, "total": lambda block: block.sum()},
        {"count": lambda block, state, key: (state + 1, jax.random.uniform(key))},
        keys={"draw": 1, "count": 0},
    )
    blocks = [PrivateSeed()(np.full(2, float(m))) for m in range(2)]
    assert blocks[0]["seed"].dtype == np.uint32
    fed = InProcess().start(ClientProgram(functions, blocks=blocks, stateful=stateful))
    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, 2)
    replies = fed.map("draw", 1.0, per_client=(keys,))
    replay = np.array([2.0 * m + jax.random.normal(keys[m]) for m in range(2)])  # the server's replay
    private = np.array([2.0 * m + jax.random.normal(jax.random.fold_in(keys[m], blocks[m]["seed"])) for m in range(2)])
    np.testing.assert_allclose(replies, private, rtol=1e-6)
    assert not np.allclose(replies, replay)
    np.testing.assert_array_equal(fed.map("total"), [0.0, 2.0])
    state, reply = fed.map("count", per_client=(keys,), state=fed.init_state(jnp.zeros(2)))
    np.testing.assert_array_equal(state.values, [1.0, 1.0])
    with pytest.raises(ValueError, match="not calls"):
        private_program({"draw": draw}, keys={"other": 0})


def test_separate_clients_is_the_seams_capability(loader):
    assert not clients_are_separate(InProcess())
    assert clients_are_separate(InProcess(loader=loader, num_clients=M))

    class Elsewhere(InProcess):  # an engine: clients run elsewhere
        in_process = False

    assert clients_are_separate(Elsewhere())


def test_private_randomness_is_checked(data):
    with pytest.raises(TypeError, match="private_randomness"):
        nf.DPPVI(model, dp="dpsgd", noise_multiplier=1.0, private_randomness="yes")


# -- FedZigZag ----------------------------------------------------------------------------------


def logistic_zz(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([2]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=2):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


DP = dict(dp_sensitivity=2.0, dp_epsilon=5.0, dp_delta=1e-3)


def zigzag_draws(federation, *args, **kw):
    kernel = nf.FedZigZag(logistic_zz, federation=federation, **DP, **kw)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=20, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(jax.random.PRNGKey(0), *args)
    return kernel, np.asarray(mcmc.get_samples()["w"])


def test_fedzigzag_with_a_guarantee_is_client_private_by_default_in_deployment(data, tmp_path):
    X, y = data
    load = save_client_rows(tmp_path, [0, ROWS // 2, ROWS], X, y)
    simulated, simulated_draws = zigzag_draws(None, X, y)
    assert not simulated.private_randomness and simulated.thinning == "server"
    assert not simulated.privacy.client_private_randomness
    kernel, first = zigzag_draws(InProcess(loader=load, num_clients=2))
    _, second = zigzag_draws(InProcess(loader=load, num_clients=2))
    assert kernel.private_randomness and kernel.thinning == "clients"
    assert kernel.privacy.client_private_randomness and "private_randomness" not in repr(kernel)
    assert np.isfinite(first).all() and not np.array_equal(first, second)
    opted_out, reproduced = zigzag_draws(InProcess(loader=load, num_clients=2), private_randomness=False)
    assert not opted_out.privacy.client_private_randomness
    np.testing.assert_array_equal(reproduced, simulated_draws)
    with pytest.raises(ValueError, match="private_randomness=False"):
        nf.FedZigZag(logistic_zz, federation=InProcess(loader=load, num_clients=2), thinning="server", **DP)
    # without a guarantee, nothing changes
    assert not nf.FedZigZag(logistic_zz, federation=InProcess(loader=load, num_clients=2)).private_randomness


# -- on a local Ray: the clients as separate workers -------------------------------------------


@pytest.mark.slow
def test_on_ray_private_runs_differ_and_do_not_replay(ray_session, data):
    key = jax.random.PRNGKey(2)
    simulated = dppvi("dpsgd").run(key, 2, *data)
    with nf.RayFederation(timeout=120.0) as federation:  # the actors are reused by each run
        runs = [dppvi("dpsgd", federation).run(key, 2, *data) for _ in range(2)]
        opted_out = dppvi("dpsgd", federation, private_randomness=False).run(key, 2, *data)
    assert all(r.privacy.client_private_randomness for r in runs)
    assert not same_q(runs[0], runs[1]) and not same_q(runs[0], simulated)
    assert same_q(opted_out, simulated) and not opted_out.privacy.client_private_randomness
