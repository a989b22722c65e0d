"""What a user forgets: the observed data (``y=None``) and the right plate size. Every
algorithm's face refuses both before any work, with one message (from the shared layer that
splits the model), while models with client-local latents that something depends on (per-row
effects, mixture assignments, per-group effects) are still accepted."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC

import numpyro_fed as nf
import numpyro_fed.potential.federated as federated_module

from models import hierarchical, linear_regression, logistic_regression, make_data, mixture, row_local_latents

MCMC_FACES = ["FedZigZag", "DADMMS", "ADMM", "DSGLD", "DSGHMC", "DULA"]
VARIATIONAL_FACES = ["DSVGD", "PDSVGD", "UDSVGD", "SVGD", "FedAvg", "DistributedSGLD"]
VARIATIONAL_FACES += ["DPPVI", "GaussianPVI", "GlobalVI", "BCM"]
FACES = MCMC_FACES + VARIATIONAL_FACES
DTYPES = ["float32", "float64"]
# Settings a face cannot run without (GlobalVI and BCM are private by default).
FACE_SETTINGS = {"GlobalVI": {"noise_multiplier": 2.0}, "BCM": {"noise_multiplier": 2.0}}
FORGOTTEN = r"site 'y' inside federated_plate 'data' has no observed value: did you forget to pass `y`\?"


def _run_face(face, model, *args):
    """Runs ``face`` on ``model`` as a user would: an MCMC kernel through ``numpyro.infer.MCMC``,
    a variational method through its ``run``."""
    key = jax.random.PRNGKey(0)
    if face in MCMC_FACES:
        MCMC(getattr(nf, face)(model), num_warmup=2, num_samples=2, progress_bar=False).run(key, *args)
    else:
        getattr(nf, face)(model, progress_bar=False, **FACE_SETTINGS.get(face, {})).run(key, 1, *args)


@pytest.fixture
def no_split_work(monkeypatch):
    """Fails the test if the model's split is built (``analyse_trace`` is its first step after
    the model's discovery trace): a refusal must come before any work."""

    def fail(*args, **kwargs):
        raise AssertionError("the model's split was built: the refusal came after work started")

    monkeypatch.setattr(federated_module, "analyse_trace", fail)


def _x64(dtype):
    return jax.enable_x64(dtype == "float64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_name", ["linear_regression", "logistic_regression"])
@pytest.mark.parametrize("face", FACES)
def test_every_face_refuses_a_forgotten_y_before_any_work(face, model_name, dtype, no_split_work):
    model = {"linear_regression": linear_regression, "logistic_regression": logistic_regression}[model_name]
    with _x64(dtype):
        X, _ = make_data(model_name)
        assert X.dtype == jnp.dtype(dtype)
        with pytest.raises(ValueError, match=FORGOTTEN) as info:
            _run_face(face, model, X)  # y forgotten
    assert "infer={'federated_latent': True}" in str(info.value)
    assert "37 values, one per row" in str(info.value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("face", FACES)
def test_every_face_names_both_sizes_of_a_plate_that_does_not_match_the_rows(face, dtype, no_split_work):
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", 30, clients=4):  # the data has 37 rows
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    with _x64(dtype):
        X, y = make_data("logistic_regression")
        mismatch = r"site 'y' has 37 rows along federated plate 'data'.*, but the plate has size 30"
        with pytest.raises(ValueError, match=mismatch):
            _run_face(face, model, X, y)


def test_the_message_is_the_same_for_every_face():
    X, _ = make_data("logistic_regression")
    messages = set()
    for face in FACES:
        with pytest.raises(ValueError) as info:
            _run_face(face, logistic_regression, X)
        messages.add(str(info.value))
    assert len(messages) == 1, messages


def test_an_observed_site_named_otherwise_is_refused_naming_the_argument_left_none():
    def model(X, labels=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=4):
            numpyro.sample("obs", dist.Bernoulli(logits=X @ w), obs=labels)

    X, _ = make_data("logistic_regression")
    with pytest.raises(ValueError, match=r"site 'obs' .* did you forget to pass `labels`\? Nothing in the model"):
        nf.split_potential(model, (X,))


def test_a_second_observed_site_forgotten_beside_a_given_one_is_refused():
    def model(counts, flags=None):
        lam = numpyro.sample("lam", dist.Gamma(2.0, 1.0))
        p = numpyro.sample("p", dist.Beta(2.0, 2.0))
        with nf.federated_plate("data", counts.shape[0], clients=3):
            numpyro.sample("counts", dist.Poisson(lam), obs=counts)
            numpyro.sample("flags", dist.Bernoulli(probs=p), obs=flags)

    counts = jnp.arange(12.0) % 4
    with pytest.raises(ValueError, match=r"site 'flags' .* did you forget to pass `flags`\?"):
        nf.split_potential(model, (counts,))
    # Given: accepted.
    nf.split_potential(model, (counts, (counts > 1) * 1.0))


def test_a_forgotten_observation_in_a_plate_federated_from_outside_is_refused():
    def plain(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    X, y = make_data("linear_regression")
    with pytest.raises(ValueError, match=FORGOTTEN):
        nf.split_potential(plain, (X,), partition={"data": 4})


@pytest.mark.parametrize("dtype", DTYPES)
def test_observed_rows_that_do_not_match_the_plate_are_named(dtype):
    with _x64(dtype):
        X, y = make_data("linear_regression")
        mismatch = r"observed site 'y' has 37 rows along federated plate 'data', but the plate has size 30"
        with pytest.raises(ValueError, match=mismatch):
            nf.split_potential(linear_regression, (X[:30], y))  # the plate's size is X.shape[0]


def _plain_regression(size=None):
    def plain(x, y):
        w = numpyro.sample("w", dist.Normal(0, 1))
        with numpyro.plate("data", x.shape[0] if size is None else size):
            numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

    return plain


@pytest.mark.parametrize(
    "clients, mismatch",
    [
        (3, r"plate 'data' \(named in partition\) has size 30, but the model's array arguments have \[37\] rows"),
        (np.arange(37) % 3, r"plate 'data' has size 30, but partition\['data'\] gives clients for 37 rows"),
        ([np.arange(20), np.arange(20, 30)], r"array arguments have \[37\] rows"),
    ],
    ids=["num-clients", "owner-array", "index-lists"],
)
def test_a_plain_plate_named_in_partition_that_does_not_match_the_rows_is_named(clients, mismatch):
    x = np.linspace(-1.0, 1.0, 37)
    with pytest.raises(ValueError, match=mismatch):
        nf.split_potential(_plain_regression(30), (x, 2 * x), partition={"data": clients})
    with pytest.raises(ValueError, match=mismatch):
        nf.DSVGD(_plain_regression(30), partition={"data": clients}).run(jax.random.PRNGKey(0), 2, x, 2 * x)
    # the plate of the data's size is federated
    fp = nf.split_potential(_plain_regression(), (x, 2 * x), partition={"data": 3})
    assert fp.num_clients == 3


def _with_replicate(mark):
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=4):
            mean = X @ w
            numpyro.sample("y", dist.Normal(mean, 1.0), obs=y)
            # A per-row draw nothing depends on: sampled only when asked for.
            numpyro.sample("y_rep", dist.Normal(mean, 1.0), infer={"federated_latent": True} if mark else None)

    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_opt_in_lets_a_per_row_latent_nothing_depends_on_be_sampled(dtype):
    with _x64(dtype):
        X, y = make_data("linear_regression")
        with pytest.raises(ValueError, match=r"site 'y_rep' .* did you forget its `obs=`\? Nothing in the model"):
            nf.split_potential(_with_replicate(mark=False), (X, y))
        fp = nf.split_potential(_with_replicate(mark=True), (X, y))
    assert fp.row_local_sites == ("y_rep",)
    assert fp.coordinate_owner.shape == (3 + X.shape[0],)


@pytest.mark.parametrize("dtype", DTYPES)
def test_client_local_latents_that_something_depends_on_are_accepted(dtype):
    with _x64(dtype):
        X, y = make_data("linear_regression")
        group = jnp.arange(X.shape[0]) % 4
        # Per-client effects (a group plate), per-row effects, enumerated mixture assignments;
        # test_potential.py checks these splits against NumPyro (validate=False: faster here).
        split = functools.partial(nf.split_potential, validate=False)
        assert split(hierarchical, (X, group, y)).num_clients == 4
        assert split(row_local_latents, make_data("row_local_latents")).row_local_sites == ("eta", "lam")
        assert split(mixture, make_data("mixture")).enumerated


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_fedzigzag_samples_the_opt_in_and_per_row_latents(dtype):
    """FedZigZag samples client-local latents. About 100 s each on 2 busy cores (compilation)."""
    face = "FedZigZag"
    with _x64(dtype):
        X, y = make_data("linear_regression")
        for model, args, site in [
            (_with_replicate(mark=True), (X, y), "y_rep"),
            (row_local_latents, make_data("row_local_latents"), "eta"),
        ]:
            mcmc = MCMC(getattr(nf, face)(model), num_warmup=5, num_samples=10, progress_bar=False)
            mcmc.run(jax.random.PRNGKey(0), *args)
            draws = mcmc.get_samples()[site]
            assert draws.shape == (10, X.shape[0]) and draws.dtype == jnp.dtype(dtype)
            assert np.isfinite(np.asarray(draws)).all()


def _radon_like(county, log_uranium, y=None, clients=None):
    """Counties' intercepts, client-local, the counties split over 4 clients (by county)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 10.0))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(1.0))
    num_counties = 17
    with nf.federated_plate("counties", num_counties, clients=np.arange(num_counties) % 4):
        alpha_raw = numpyro.sample("alpha_raw", dist.Normal(0.0, 1.0))
    alpha = mu + tau * alpha_raw
    with nf.federated_plate("data", county.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(alpha[county] + beta * log_uranium, sigma), obs=y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_hierarchical_model_split_by_group_is_accepted_and_its_forgotten_y_refused(dtype):
    with _x64(dtype):
        rng = np.random.default_rng(0)
        county = np.repeat(np.arange(17), 5)
        log_uranium = jnp.asarray(rng.normal(size=county.shape[0]) * 3.0)
        y = jnp.asarray(rng.normal(size=county.shape[0]) + 1.5)
        clients = county % 4
        fp = nf.split_potential(_radon_like, (jnp.asarray(county), log_uranium, y), {"clients": clients})
        assert set(fp.plates) == {"counties", "data"}
        assert not fp.plates["counties"].holds_data
        with pytest.raises(ValueError, match=FORGOTTEN + r" The model's argument"):
            nf.split_potential(_radon_like, (jnp.asarray(county), log_uranium), {"clients": clients})


def test_a_forgotten_observation_something_depends_on_is_refused_by_its_argument_name():
    """A covariate measured with error: ``x`` is observed, ``y`` depends on it. Forgetting
    ``x`` would leave a per-row latent that ``y`` depends on; its name gives it away."""

    def model(x=None, y=None, clients=4):
        a = numpyro.sample("a", dist.Normal(0, 1))
        b = numpyro.sample("b", dist.Normal(0, 1))
        with nf.federated_plate("data", y.shape[0], clients=clients):
            x = numpyro.sample("x", dist.Normal(0, 3), obs=x)
            numpyro.sample("y", dist.Normal(a + b * x, 1.0), obs=y)

    x = jnp.linspace(-2.0, 2.0, 12)
    message = r"site 'x' .* forget to pass `x`\? The model's argument `x` is None, so .* instead of conditioning"
    with pytest.raises(ValueError, match=message):
        nf.split_potential(model, (), {"y": 1.0 + 0.5 * x})
    nf.split_potential(model, (x, 1.0 + 0.5 * x))


def test_a_loader_that_forgets_y_is_refused_in_deployment():
    X, y = make_data("logistic_regression")
    parts = np.array_split(np.arange(X.shape[0]), 4)
    with pytest.raises(ValueError, match=FORGOTTEN):
        nf.split_potential(logistic_regression, loader=lambda m: (np.asarray(X)[parts[m]],), num_clients=4)
    fp = nf.split_potential(
        logistic_regression, loader=lambda m: (np.asarray(X)[parts[m]], np.asarray(y)[parts[m]]), num_clients=4
    )
    assert fp.deployed
