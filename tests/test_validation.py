"""Bad input gets a clear error naming the site, plate or argument at fault."""

import numpy as np
import pytest

import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf

from models import logistic_regression, make_data

X, Y = make_data("logistic_regression", num_rows=12)


def split(clients, model=logistic_regression, args=(X, Y), **kwargs):
    return nf.split_potential(model, args, {"clients": clients}, **kwargs)


@pytest.mark.parametrize(
    "clients, message",
    [
        ([[0, 1, 2, 3], [3, 4, 5, 6, 7, 8, 9, 10, 11]], "clients overlap: row 3 is listed by client 0 and client 1"),
        ([[0, 1, 2], [4, 5, 6, 7, 8, 9, 10, 11]], r"miss 1 row\(s\), e.g. \[3\]"),
        ([[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]], r"client 1 lists row 12, outside 0..11"),
        ([[0, 1, 2, -1], [3, 4, 5, 6, 7, 8, 9, 10, 11]], r"client 0 lists row -1, outside 0..11"),
        ([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]], "client 0 lists row 0 more than once"),
        ([list(range(12)), []], "client 1 owns no rows"),
        (np.array([0, 0, 0, 2, 2, 2, 0, 0, 0, 2, 2, 2]), r"clients \[1\] own no rows"),
        (np.array([0, 1, 0, 1, 0, 1, -1, 1, 0, 1, 0, 1]), "row 6 has client -1"),
        (np.array([0, 1, 0, 1]), "`clients` has 4 entries but the plate has 12 rows"),
        (0, "the number of clients must be at least 1"),
        (13, "cannot split 12 rows over 13 clients"),
    ],
)
def test_bad_client_specs(clients, message):
    with pytest.raises(ValueError, match=message):
        split(clients)


def test_clients_must_be_integers():
    with pytest.raises(TypeError, match="must hold integers, got dtype float64"):
        split(np.linspace(0, 1, 12))
    with pytest.raises(TypeError, match="`clients` is required"):
        nf.federated_plate("data", 3, clients=None)


def test_model_without_federated_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    with pytest.raises(ValueError, match="the model has no federated plate"):
        nf.split_potential(model, (X, Y))
    with pytest.raises(ValueError, match="partition names plate 'rows'.*plates: \\['data'\\]"):
        nf.split_potential(model, (X, Y), partition={"rows": 2})


def test_partition_cannot_rename_a_federated_plate():
    with pytest.raises(ValueError, match="already a federated_plate"):
        nf.split_potential(logistic_regression, (X, Y), {"clients": 2}, partition={"data": 3})


def test_plate_size_must_match_the_data():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", 12, clients=2):
            numpyro.sample("y", dist.Bernoulli(logits=(X @ w)[:12]), obs=y)

    with pytest.raises(
        ValueError, match="observed site 'y' has 11 rows along federated plate 'data', but the plate has size 12"
    ):
        nf.split_potential(model, (X, Y[:11]))


def test_subsampled_federated_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2, subsample_size=4) as idx:
            numpyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])

    with pytest.raises(ValueError, match=r"federated plate 'data' is subsampled \(subsample_size=4 of 12\)"):
        nf.split_potential(model, (X, Y))


def test_global_discrete_latent():
    def model(X, y):
        k = numpyro.sample("k", dist.Categorical(jnp.ones(3) / 3))
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w + k), obs=y)

    with pytest.raises(ValueError, match="site 'k' is a global discrete latent variable"):
        nf.split_potential(model, (X, Y))


def test_non_finite_data():
    bad_y = Y.at[5].set(jnp.nan)
    with pytest.raises(
        ValueError, match=r"model argument \['model_args'\]\[1\] holds non-finite values \(first at index \[5\]\)"
    ):
        split(2, args=(X, bad_y))
    bad_X = X.at[7, 1].set(jnp.inf)
    with pytest.raises(
        ValueError, match=r"model argument \['model_args'\]\[0\] holds non-finite values \(first at index \[7, 1\]\)"
    ):
        split(2, args=(bad_X, Y))


def test_non_finite_observation_that_is_not_an_argument():
    def model(X):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            numpyro.sample("y", dist.Normal(X @ w, 1), obs=jnp.log(X[:, 0]))

    with pytest.raises(ValueError, match=r"observed site 'y' holds non-finite data \(first at index \[0\]\)"):
        nf.split_potential(model, (jnp.abs(X).at[0, 0].set(0.0),))


def test_numpy_on_a_row_argument_is_refused_naming_the_arguments_and_the_remedy():
    """NumPyro's NUTS runs this model (its data are constants there); a client's functions trace
    the rows, where a NumPy owner indexed by a row argument cannot be evaluated: a ValueError
    of ours, not JAX's TracerArrayConversionError."""
    group_scale = np.array([1.0, 2.0, 0.5])

    def model(X, group, y):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            numpyro.sample("y", dist.Normal(X @ w, group_scale[group]), obs=y)

    group = np.arange(X.shape[0]) % 3
    with pytest.raises(ValueError, match=r"cannot run on its rows as JAX arrays.*\(X, group, y\) traced.*jnp\.asarray"):
        nf.split_potential(model, (X, group, Y))

    def fixed(X, group, y):  # the remedy the message gives
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            numpyro.sample("y", dist.Normal(X @ w, jnp.asarray(group_scale)[group]), obs=y)

    assert nf.split_potential(fixed, (X, group, Y)).num_clients == 2


def test_prior_that_depends_on_client_data():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0, jnp.std(X)).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    with pytest.raises(ValueError, match=r"the prior term of site\(s\) \['w'\] depends on client data"):
        nf.split_potential(model, (X, Y))


def test_model_that_pools_rows_inside_the_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            centred = X - X.mean(0)  # an aggregate over all clients' rows
            numpyro.sample("y", dist.Bernoulli(logits=centred @ w), obs=y)

    with pytest.raises(ValueError, match="differs from NumPyro's potential energy"):
        nf.split_potential(model, (X, Y))


def test_data_not_passed_as_argument():
    def model(X_columns):  # rows on the last axis, observations captured from outside
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", 12, clients=2):
            numpyro.sample("y", dist.Bernoulli(logits=X_columns.T @ w), obs=Y)

    with pytest.raises(ValueError, match="no model argument has 12 rows on its leading axis"):
        nf.split_potential(model, (X.T,))


def test_nested_federated_plates():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0, 1))
        with nf.federated_plate("outer", 3, clients=3, dim=-2):
            with nf.federated_plate("inner", 4, clients=2, dim=-1):
                numpyro.sample("y", dist.Normal(mu, 1), obs=y)

    with pytest.raises(ValueError, match=r"site 'y' is inside nested federated plates \['inner', 'outer'\]"):
        nf.split_potential(model, (jnp.zeros((3, 4)),))


def test_plates_disagreeing_on_the_number_of_clients():
    def model(X, y):
        u = None
        with nf.federated_plate("clients", 3, clients=3):
            u = numpyro.sample("u", dist.Normal(0, 1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            numpyro.sample("y", dist.Bernoulli(logits=X[:, 0] + u[0]), obs=y)

    with pytest.raises(ValueError, match="disagree on the number of clients"):
        nf.split_potential(model, (X, Y))
