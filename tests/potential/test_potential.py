"""The split is exact: prior + sum(clients) == NumPyro's potential energy, values and gradients."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
from numpyro.infer.util import initialize_model

import numpyro_fed as nf

from models import MODELS, NUM_CLIENTS, hierarchical, make_data, owners_in_three_forms

FORMS = ["int", "array", "list"]
TOL = 1e-10


def _random_points(init_params, num=3, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), num)
    return [jax.tree.map(lambda a, k=k: a + 0.7 * jax.random.normal(k, jnp.shape(a)), init_params) for k in keys]


def _model_and_args(name, form):
    clients, owner = owners_in_three_forms()[form]
    if name == "hierarchical":
        X, y = make_data("linear_regression")
        return hierarchical, (X, jnp.asarray(owner), y), {"clients": clients}
    return MODELS[name], make_data(name), {"clients": clients}


def _assert_split_matches_numpyro(model, args, kwargs, **split_options):
    fp = nf.split_potential(model, args, kwargs, **split_options)
    reference = initialize_model(jax.random.PRNGKey(0), model, model_args=args, model_kwargs=kwargs).potential_fn
    ref_value_and_grad = jax.jit(jax.value_and_grad(reference))
    for z in _random_points(fp.init_params):
        ref_value, ref_grad = ref_value_and_grad(z)
        prior = fp.prior_potential(z)
        clients = fp.client_potentials(z)
        assert clients.shape == (fp.num_clients,)
        assert abs(float(prior + clients.sum() - ref_value)) < TOL * max(1.0, abs(float(ref_value)))
        assert abs(float(fp.potential(z) - ref_value)) < TOL * max(1.0, abs(float(ref_value)))

        prior_grad = fp.prior_grad(z)
        client_grads = fp.client_grads(z)
        for site in z:
            assert client_grads[site].shape == (fp.num_clients,) + jnp.shape(z[site])
            total = prior_grad[site] + client_grads[site].sum(0)
            np.testing.assert_allclose(total, ref_grad[site], rtol=TOL, atol=TOL)
            np.testing.assert_allclose(fp.grad(z)[site], ref_grad[site], rtol=TOL, atol=TOL)
    return fp


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(MODELS) + ["hierarchical"])
def test_prior_plus_clients_equals_numpyro_potential(name, form):
    fp = _assert_split_matches_numpyro(*_model_and_args(name, form))
    assert fp.num_clients == NUM_CLIENTS
    _, owner = owners_in_three_forms()[form]
    np.testing.assert_array_equal(fp.client_sizes, np.bincount(owner, minlength=NUM_CLIENTS))


def test_mixture_is_enumerated_and_every_client_term_differs():
    model, args, kwargs = _model_and_args("mixture", "array")
    fp = nf.split_potential(model, args, kwargs)
    assert fp.enumerated
    values = np.asarray(fp.client_potentials(fp.init_params))
    assert len(np.unique(values)) == NUM_CLIENTS


@pytest.mark.parametrize("form", FORMS)
def test_client_gradient_is_zero_on_other_clients_coordinates(form):
    fp = nf.split_potential(*_model_and_args("hierarchical", form))
    owner = fp.coordinate_owner
    # u and sigma_c: one coordinate per client each; mu, tau, w: global.
    assert (owner >= 0).sum() == 2 * NUM_CLIENTS
    assert sorted(owner[owner >= 0].tolist()) == sorted(list(range(NUM_CLIENTS)) * 2)
    for z in _random_points(fp.init_params):
        flat_grads = np.asarray(jax.vmap(fp.ravel)(fp.client_grads(z)))
        for m in range(NUM_CLIENTS):
            others = (owner >= 0) & (owner != m)
            assert np.all(flat_grads[m, others] == 0.0)
            assert np.all(flat_grads[m, owner == m] != 0.0)
        prior_flat = np.asarray(fp.ravel(fp.prior_grad(z)))
        assert np.all(prior_flat[owner >= 0] == 0.0)


def test_row_local_latents_belong_to_their_rows_client():
    clients, owner = owners_in_three_forms()["array"]
    X, y = make_data("row_local_latents")
    fp = nf.split_potential(MODELS["row_local_latents"], (X, y), {"clients": clients})
    tree = fp.coordinate_owner_tree
    np.testing.assert_array_equal(tree["eta"], owner)
    np.testing.assert_array_equal(tree["w"], -1)
    z = _random_points(fp.init_params)[0]
    grads = fp.client_grads(z)
    for m in range(NUM_CLIENTS):
        assert np.all(np.asarray(grads["eta"][m])[owner != m] == 0.0)
    constrained = fp.postprocess_fn(z)
    np.testing.assert_allclose(constrained["eta"], z["eta"])
    np.testing.assert_allclose(constrained["lam"], jnp.exp(z["lam"]), rtol=1e-12)


def test_postprocess_matches_numpyro_constrained_values():
    model, args, kwargs = _model_and_args("hierarchical", "list")
    fp = nf.split_potential(model, args, kwargs)
    info = initialize_model(jax.random.PRNGKey(0), model, model_args=args, model_kwargs=kwargs)
    z = _random_points(fp.init_params)[1]
    ours, theirs = fp.postprocess_fn(z), info.postprocess_fn(z)
    assert set(ours) == set(theirs)
    for site in theirs:
        np.testing.assert_allclose(ours[site], theirs[site], rtol=1e-12)


def test_partition_federates_an_unmodified_model():
    import numpyro.distributions as dist

    def plain_model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    clients, owner = owners_in_three_forms()["list"]
    args = make_data("logistic_regression")
    fp = _assert_split_matches_numpyro(plain_model, args, {}, partition={"data": clients})
    np.testing.assert_array_equal(fp.client_sizes, np.bincount(owner))
    federated = nf.split_potential(MODELS["logistic_regression"], args, {"clients": clients})
    z = _random_points(fp.init_params)[0]
    np.testing.assert_allclose(fp.client_potentials(z), federated.client_potentials(z), rtol=1e-13)


def test_each_client_function_sees_only_its_rows():
    clients, owner = owners_in_three_forms()["array"]
    X, y = make_data("logistic_regression")
    fp = nf.split_potential(MODELS["logistic_regression"], (X, y), {"clients": clients})
    stacked_X, stacked_y = fp.client_data["rows"][:2]
    valid = np.asarray(fp.client_data["valid"]["data"])
    for m in range(NUM_CLIENTS):
        rows = np.flatnonzero(owner == m)
        np.testing.assert_array_equal(np.asarray(stacked_X[m])[valid[m]], np.asarray(X)[rows])
        np.testing.assert_array_equal(np.asarray(stacked_y[m])[valid[m]], np.asarray(y)[rows])
        # padding repeats the client's own rows only
        padded = {tuple(r) for r in np.asarray(stacked_X[m])}
        assert padded <= {tuple(r) for r in np.asarray(X)[rows]}


@pytest.mark.parametrize("form", FORMS)
def test_row_arguments_need_not_be_valid_when_zero(form):
    # Row-indexed covariance matrices as a model argument: the server's view replaces client
    # rows by a zero placeholder, which is not a valid covariance; its sites are masked out,
    # so the split must neither validate nor evaluate them.
    import numpyro.distributions as dist

    clients, owner = owners_in_three_forms()[form]
    n = len(owner)
    cov = jnp.array([[1.0, 0.3], [0.3, 2.0]]) * (1.0 + jnp.arange(n))[:, None, None]
    y = jax.random.normal(jax.random.PRNGKey(3), (n, 2))

    def model(y, cov, clients):
        mu = numpyro.sample("mu", dist.Normal(0, 1).expand([2]).to_event(1))
        with nf.federated_plate("data", y.shape[0], clients=clients):
            numpyro.sample("y", dist.MultivariateNormal(mu, covariance_matrix=cov), obs=y)

    with numpyro.validation_enabled(True):
        fp = _assert_split_matches_numpyro(model, (y, cov, clients), {})
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(fp.prior_grad(fp.init_params)))
