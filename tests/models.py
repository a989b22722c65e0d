"""Models shared by the tests: each takes its data and a ``clients`` spec as arguments."""

import numpy as np

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf

NUM_ROWS = 37
NUM_CLIENTS = 4


def linear_regression(X, y=None, clients=NUM_CLIENTS):
    w = numpyro.sample("w", dist.Normal(0, 2).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0, 2))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(X @ w + b, sigma), obs=y)


def logistic_regression(X, y=None, clients=NUM_CLIENTS):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def poisson_glm(X, y=None, clients=NUM_CLIENTS):
    # A global shrinkage scale on the positive reals (log-Jacobian in the prior term).
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    w = numpyro.sample("w", dist.Normal(0, tau).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Poisson(jnp.exp(0.3 * (X @ w))), obs=y)


def hierarchical(X, group, y=None, clients=NUM_CLIENTS):
    """Per-client random intercepts and noise scales: client-local latent variables."""
    num_clients = NUM_CLIENTS
    mu = numpyro.sample("mu", dist.Normal(0, 2))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("clients", num_clients, clients=num_clients):
        u = numpyro.sample("u", dist.Normal(mu, tau))
        sigma_c = numpyro.sample("sigma_c", dist.LogNormal(0.0, 0.5))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(X @ w + u[group], sigma_c[group]), obs=y)


def student_t_regression(X, y=None, clients=NUM_CLIENTS):
    w = numpyro.sample("w", dist.Normal(0, 2).expand([X.shape[1]]).to_event(1))
    nu = numpyro.sample("nu", dist.Uniform(1.0, 30.0))  # constrained degrees of freedom
    scale = numpyro.sample("scale", dist.HalfNormal(1.0))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.StudentT(nu, X @ w, scale), obs=y)


def mixture(y, clients=NUM_CLIENTS):
    """Two-component mixture; the assignment of each row is enumerated out."""
    weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(2)))
    locs = numpyro.sample("locs", dist.Normal(jnp.array([-1.0, 1.0]), 2.0).to_event(1))
    scale = numpyro.sample("scale", dist.HalfNormal(2.0))
    with nf.federated_plate("data", y.shape[0], clients=clients):
        z = numpyro.sample("z", dist.Categorical(weights), infer={"enumerate": "parallel"})
        numpyro.sample("y", dist.Normal(locs[z], scale), obs=y)


def row_local_latents(X, y=None, clients=NUM_CLIENTS):
    """A latent per data row (e.g. a per-observation random effect) lives with its row."""
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        eta = numpyro.sample("eta", dist.Normal(X @ w, 0.5))
        lam = numpyro.sample("lam", dist.Gamma(2.0, 2.0))
        numpyro.sample("y", dist.Normal(eta, lam), obs=y)


# Rubin's eight schools (the school effects' data: estimates and their standard errors)
SCHOOL_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SCHOOL_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
SCHOOL_ARGS = (np.arange(8), SCHOOL_SIGMA, SCHOOL_Y)


def eight_schools(clients):
    """Eight schools non-centred, ``tau ~ HalfCauchy(5)``, each school's effect client-local on
    the client that owns the school (``clients``: a count, schools split evenly, or owners)."""

    def model(school, sigma, y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with nf.federated_plate("schools", 8, clients=clients):
            theta_tilde = numpyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        with nf.federated_plate("data", y.shape[0], clients=clients):
            numpyro.sample("y", dist.Normal(mu + tau * theta_tilde[school], sigma), obs=y)

    return model


def owners_in_three_forms(num_rows=NUM_ROWS, num_clients=NUM_CLIENTS, seed=0):
    """The same unequal, non-contiguous split written as an owner array and as index lists,
    plus the int form (an even contiguous split)."""
    rng = np.random.default_rng(seed)
    owner = rng.choice(num_clients, size=num_rows, p=[0.1, 0.2, 0.3, 0.4][:num_clients])
    owner[:num_clients] = np.arange(num_clients)  # every client owns a row
    rng.shuffle(owner)
    index_lists = [np.flatnonzero(owner == m) for m in range(num_clients)]
    even_owner = np.concatenate(
        [np.full(len(r), m) for m, r in enumerate(np.array_split(np.arange(num_rows), num_clients))]
    )
    return {
        "int": (num_clients, even_owner),
        "array": (owner, owner),
        "list": (index_lists, owner),
    }


def make_data(name, seed=0, num_rows=NUM_ROWS):
    """Model arguments (without ``clients``) for the named test model."""
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    X = jax.random.normal(k1, (num_rows, 3))
    if name == "linear_regression":
        return (X, X @ jnp.array([1.0, -0.5, 0.2]) + 0.3 * jax.random.normal(k2, (num_rows,)))
    if name == "logistic_regression":
        return (X, jax.random.bernoulli(k2, jax.nn.sigmoid(X @ jnp.array([1.0, -1.0, 0.5]))) * 1.0)
    if name == "poisson_glm":
        return (X, jax.random.poisson(k2, jnp.exp(0.3 * X[:, 0])) * 1.0)
    if name == "student_t_regression":
        return (X, X @ jnp.array([1.0, 0.0, -1.0]) + jax.random.t(k2, 3.0, (num_rows,)))
    if name == "mixture":
        comp = jax.random.bernoulli(k2, 0.4, (num_rows,))
        return (jnp.where(comp, -2.0, 2.0) + 0.7 * jax.random.normal(k3, (num_rows,)),)
    if name == "row_local_latents":
        return (X, X @ jnp.array([0.5, 0.5, 0.0]) + jax.random.normal(k2, (num_rows,)))
    raise KeyError(name)


MODELS = {
    "linear_regression": linear_regression,
    "logistic_regression": logistic_regression,
    "poisson_glm": poisson_glm,
    "student_t_regression": student_t_regression,
    "mixture": mixture,
    "row_local_latents": row_local_latents,
}


# -- the privacy tests' logistic regression -------------------------------------------------

PRIVATE_CLIENTS, PRIVATE_ROWS = 3, 90


def private_logistic(X, y=None):
    """Logistic regression over ``PRIVATE_CLIENTS`` clients: the privacy tests' model."""
    w = numpyro.sample("w", dist.Normal(0, 1).expand([2]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=PRIVATE_CLIENTS):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def private_logistic_data():
    """``(X, y)``: ``PRIVATE_ROWS`` rows of two covariates, logistic labels (seed 0)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(PRIVATE_ROWS, 2))
    y = (X @ np.array([1.0, -1.0]) + rng.logistic(size=PRIVATE_ROWS) > 0).astype(float)
    return X, y
