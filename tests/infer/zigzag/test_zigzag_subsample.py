"""FedZigZag(subsample_size=...): rates estimated from a few rows of each client around the
control variates' reference (Bierkens, Fearnhead & Roberts 2019), checked against NumPyro's
NUTS on the pooled data and against closed-form posteriors.

Tolerances come from the Monte Carlo error: a mean estimated from ``ESS`` effective draws has
standard error ``sd / sqrt(ESS)``; two independent estimates differ by at most
``Z * sd * sqrt(1 / ESS_a + 1 / ESS_b)`` with ``Z = 4.5`` (two-sided probability about 7e-6
per coordinate, so that a test with a dozen coordinates fails by chance about once in 10^4
runs). A standard deviation estimated from ``ESS`` draws has relative error about
``1 / sqrt(2 ESS)``; we allow ``Z`` of those plus 2% for the ESS estimate's own error.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed.federation import InProcess

Z = 4.5


def logistic(X, y=None, clients=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def poisson(X, y=None, clients=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0, 1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w + b)), obs=y)


def linear(X, y=None, clients=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def random_intercepts(X, group, y=None, clients=None, num_clients=4):
    """Per-client intercepts: client-local latent variables, Gaussian (closed form)."""
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("clients", num_clients, clients=num_clients):
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(X @ w + u[group], 1.0), obs=y)


def unequal_owner(n, seed=0, num_clients=4):
    """Each row's client, sizes about 10%, 20%, 30%, 40% of the rows."""
    rng = np.random.default_rng(seed)
    owner = rng.choice(num_clients, size=n, p=[0.1, 0.2, 0.3, 0.4])
    owner[:num_clients] = np.arange(num_clients)
    return owner


def logistic_data(n=400, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))).astype(float)
    return X, y, unequal_owner(n, seed)


def run_zigzag(model, args, *, num_samples=1000, num_warmup=100, seed=0, **options):
    options.setdefault("sample_interval", 0.1)
    kernel = nf.FedZigZag(model, **options)
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *args)
    return kernel, mcmc


def run_nuts(model, args, num_samples=1000):
    mcmc = MCMC(NUTS(model), num_warmup=300, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(11), *args)
    return mcmc.get_samples()


def flat(samples, names):
    return np.concatenate([np.asarray(samples[n]).reshape(len(samples[n]), -1) for n in names], axis=1)


def ess(draws):
    return np.asarray(effective_sample_size(np.asarray(draws)[None]))


def assert_agree_with_draws(draws, reference):
    """Means and sds of two independent sets of draws agree within their Monte Carlo errors."""
    ess_a, ess_b = ess(draws), ess(reference)
    assert ess_a.min() > 100, ess_a
    sd = reference.std(0)
    error = Z * sd * np.sqrt(1 / ess_a + 1 / ess_b)
    np.testing.assert_array_less(np.abs(draws.mean(0) - reference.mean(0)), error)
    rel = Z * np.sqrt(1 / (2 * ess_a) + 1 / (2 * ess_b)) + 0.02
    np.testing.assert_array_less(np.abs(draws.std(0) / sd - 1), rel)


def assert_agree_with_exact(draws, mean, sd):
    """Means and sds of the draws agree with the exact posterior's within Monte Carlo error."""
    n_eff = ess(draws)
    assert n_eff.min() > 100, n_eff
    np.testing.assert_array_less(np.abs(draws.mean(0) - mean), Z * sd / np.sqrt(n_eff))
    np.testing.assert_array_less(np.abs(draws.std(0) / sd - 1), Z / np.sqrt(2 * n_eff) + 0.02)


def gaussian_posterior(Z_design, y, noise_sd, prior_sd=1.0):
    precision = np.eye(Z_design.shape[1]) / prior_sd**2 + Z_design.T @ Z_design / noise_sd**2
    cov = np.linalg.inv(precision)
    return cov @ Z_design.T @ y / noise_sd**2, np.sqrt(np.diag(cov))


# -- agreement -------------------------------------------------------------------------------


@pytest.mark.slow
def test_logistic_unequal_clients_agrees_with_nuts_without_violations():
    """Logistic regression over unequal clients, the automatic bounds: NUTS's posterior and
    not one proposal whose estimated rate exceeded its bound (the logistic curvature is
    bounded by its value at the origin, one of the points the clients look at)."""
    X, y, owner = logistic_data(200)
    kernel, mcmc = run_zigzag(logistic, (X, y, owner), subsample_size=2)
    fields = mcmc.get_extra_fields()
    assert int(fields["info.num_violations"].sum()) == 0
    assert int(fields["info.num_events"].sum()) > 300  # the check had proposals to fail on
    assert not kernel.unbounded_curvature
    assert_agree_with_draws(np.asarray(mcmc.get_samples()["w"]), np.asarray(run_nuts(logistic, (X, y, owner))["w"]))


def assert_importance_bound(bound, X, owner, margin):
    """In process the rows are drawn in proportion to their curvature bound along the
    proposal's coordinate, ``c_Ji = |a_Ji| sum_k |a_Jk| / 4`` for logistic rows, and the
    estimate's deviation is bounded by ``S_i = sum_J c_Ji`` times the largest distance to
    the reference (times the margin, and up to the rounding of the integer sampling
    weights: at most one part in 2**31 / n_m per row, 1e-4 here); the rows leave no
    Hessian part (no client-level terms)."""
    sup = np.asarray(bound.sup)
    for m in range(4):
        rows = np.abs(X[owner == m])
        total = margin * np.sum(rows * rows.sum(1, keepdims=True), axis=0) / 4
        assert np.all(sup[m] >= total * (1 - 1e-12))
        np.testing.assert_allclose(sup[m], total, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(bound.clients)[:4], 0.0)


def test_automatic_logistic_bound_is_the_supremum_and_never_violated():
    """The logistic curvature s(1 - s) a a^T peaks at the origin, one of the points the
    clients look at: each row's automatic bound is the margin times |a_J a_J^T| / 4 (a true
    bound), and a run has no violation."""
    X, y, owner = logistic_data(200)
    kernel, mcmc = run_zigzag(
        logistic, (X, y, owner), subsample_size=2, num_samples=300, control_variates="first_order"
    )
    fields = mcmc.get_extra_fields()
    assert int(fields["info.num_violations"].sum()) == 0 and int(fields["info.num_events"].sum()) > 100
    assert not kernel.unbounded_curvature
    assert kernel.subsample_bounds.second is None
    assert_importance_bound(kernel.subsample_bounds, X, owner, margin=1.25)
    np.testing.assert_allclose(np.asarray(kernel.subsample_bounds.prior), 1.25 * np.eye(3), atol=1e-12)


def test_a_proposal_costs_the_batch_whatever_the_client_size():
    """The clients' rows evaluated per check are 2 b (the batch at the point and at the
    reference), and sample_stats reports them: gradient evaluations times 2 b."""
    X, y, owner = logistic_data(100)
    kernel, mcmc = run_zigzag(logistic, (X, y, owner), subsample_size=3, num_samples=20, num_warmup=10)
    np.testing.assert_array_equal(kernel.rows_per_gradient, [6, 6, 6, 6])
    stats = kernel.sample_stats(mcmc.get_extra_fields(group_by_chain=True))
    evals = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["info.grad_evals_by_proposer"])[..., :4]
    np.testing.assert_array_equal(stats["grad_row_evals_by_client"][0], 6 * evals)
    np.testing.assert_array_equal(stats["grad_row_evals"][0], 6 * evals.sum(-1))
    # only checks evaluate gradients: one per proposal a client won
    assert stats["grad_row_evals"][0].sum() <= 6 * int(mcmc.get_extra_fields()["info.num_proposals"].sum())
    # without subsampling a gradient costs the client's rows
    full, _ = run_zigzag(logistic, (X, y, owner), num_samples=1, num_warmup=0)
    np.testing.assert_array_equal(full.rows_per_gradient, np.bincount(owner))


def test_linear_regression_agrees_with_the_closed_form():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(300, 3))
    y = X @ np.array([0.5, -0.2, 0.3]) + 0.5 * rng.normal(size=300)
    owner = unequal_owner(300, 3)
    kernel, mcmc = run_zigzag(linear, (X, y, owner), subsample_size=1, sample_interval=0.05)
    mean, sd = gaussian_posterior(X, y, 0.5)
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
    assert not kernel.unbounded_curvature  # a constant curvature: the bound is global
    assert_agree_with_exact(np.asarray(mcmc.get_samples()["w"]), mean, sd)


def test_second_order_on_a_gaussian_target_rejects_nothing():
    """Second order (the default in process): on linear regression the rows' gradients are
    affine, every remainder after the Taylor term is zero, the automatic remainder bound is
    zero, and the rows' bound is the exact rate: a proposal is rejected only where the prior's
    term (bounded through its curvature, ``2 max |H_0| |x - x*|``, small against the rows')
    proposed it."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(300, 3))
    y = X @ np.array([0.5, -0.2, 0.3]) + 0.5 * rng.normal(size=300)
    owner = unequal_owner(300, 3)
    kernel, mcmc = run_zigzag(linear, (X, y, owner), subsample_size=1, sample_interval=0.05, num_samples=300)
    bound = kernel.subsample_bounds
    assert bound.second is not None and float(bound.horizon) > 0
    np.testing.assert_allclose(np.asarray(bound.second), 0.0, atol=1e-9)
    fields = mcmc.get_extra_fields()
    proposals, events = int(fields["info.num_proposals"].sum()), int(fields["info.num_events"].sum())
    assert events > 300 and proposals - events <= 0.01 * proposals
    assert int(fields["info.num_violations"].sum()) == 0


def logistic_third(x, y, client):
    """|w^T (d_i H_J) w| = |s''(a.x)| |a_i| (a.w)^2 <= |a_i| |a|^2 / (6 sqrt(3)) |w|^2."""
    return jnp.abs(x) * (x @ x) / (6 * jnp.sqrt(3.0))


def test_second_order_user_third_bound_is_summed_per_coordinate():
    """RowHessianBound(third=...): each client's remainder bound along i is the sum over its
    rows of third_J[i] / 2 (no margin, no floor); with a diagonal preconditioner the rows'
    bound in u is |S|^T third_J |S|_2^2; no violation."""
    X, y, owner = logistic_data(200, seed=3)
    bound = nf.RowHessianBound(
        lambda x, y, client: jnp.abs(jnp.outer(x, x)) / 4, prior=jnp.eye(3), third=logistic_third
    )
    for preconditioner in (None, "diagonal"):
        kernel, mcmc = run_zigzag(
            logistic,
            (X, y, owner),
            subsample_size=1,
            bounds=bound,
            num_samples=200,
            preconditioner=preconditioner,
            sample_interval=None,
        )
        assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
        scale = np.ones(3) if preconditioner is None else np.abs(np.asarray(kernel.preconditioning.scale))
        second = np.asarray(kernel.subsample_bounds.second)
        for m in range(4):
            rows = X[owner == m]
            per_row = np.abs(rows) * (rows**2).sum(1, keepdims=True) / (6 * np.sqrt(3.0)) / 2
            np.testing.assert_allclose(second[m], (per_row * scale).sum(0) * scale.max() ** 2, rtol=1e-4)
        np.testing.assert_array_equal(second[4], 0.0)  # the server's prior proposer holds no rows


def test_second_order_automatic_bound_within_the_exact_one():
    """The automatic remainder bound of logistic rows (the third derivative found along each
    row's own direction at points around the posterior) is at most the margin times the
    exact supremum plus the floor, and a run with it has no violation."""
    X, y, owner = logistic_data(200, seed=4)
    kernel, mcmc = run_zigzag(logistic, (X, y, owner), subsample_size=1, num_samples=300)
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
    assert not kernel.unbounded_curvature
    second = np.asarray(kernel.subsample_bounds.second)
    for m in range(4):
        rows = X[owner == m]
        exact = (np.abs(rows) * (rows**2).sum(1, keepdims=True) / (6 * np.sqrt(3.0)) / 2).sum(0)
        assert np.all(second[m] <= 1.25 * (1 + 0.05) * exact * (1 + 1e-4))
        assert np.all(second[m] > 0.1 * exact)  # and not vanishingly small


def test_preconditioned_on_correlated_covariates_agrees_with_the_closed_form():
    """Two nearly collinear covariates (posterior correlation about -0.99): with the Laplace
    preconditioner the rows are weighed and the rates bounded in ``u``, and the draws match the
    exact posterior; without it the same run barely moves along the ridge."""
    rng = np.random.default_rng(5)
    n = 400
    base = rng.normal(size=(n, 1))
    X = np.concatenate([base, base + 0.1 * rng.normal(size=(n, 1)), rng.normal(size=(n, 1))], 1)
    y = X @ np.array([0.5, -0.2, 0.3]) + 0.5 * rng.normal(size=n)
    owner = unequal_owner(n, 5)
    mean, sd = gaussian_posterior(X, y, 0.5)
    kernel, mcmc = run_zigzag(linear, (X, y, owner), subsample_size=1, sample_interval=None, preconditioner="laplace")
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
    assert not kernel.unbounded_curvature
    draws = np.asarray(mcmc.get_samples()["w"])
    assert_agree_with_exact(draws, mean, sd)
    _, plain = run_zigzag(linear, (X, y, owner), subsample_size=1, sample_interval=None)
    assert ess(np.asarray(plain.get_samples()["w"]))[:2].max() < ess(draws)[:2].min() / 10


def test_preconditioned_with_user_row_bound_has_no_violation():
    """A user's per-row bound (in x) carried into u as |S|^T B |S|: exact, no violation, and
    agreement with the closed form (linear regression: |d_i d_k U_J| = |x_i x_k| / 0.25)."""
    rng = np.random.default_rng(6)
    X = rng.normal(size=(300, 3)) * np.array([1.0, 5.0, 0.2])  # unequal scales
    y = X @ np.array([0.5, -0.2, 0.3]) + 0.5 * rng.normal(size=300)
    owner = unequal_owner(300, 6)
    bound = nf.RowHessianBound(lambda x, y, client: jnp.abs(jnp.outer(x, x)) / 0.25, prior=jnp.eye(3))
    kernel, mcmc = run_zigzag(
        linear, (X, y, owner), subsample_size=1, sample_interval=None, preconditioner="diagonal", bounds=bound
    )
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
    # the bound is the user's in u: each row's |S| |x x^T| |S| / 0.25 summed along its coordinate
    scale = np.abs(np.asarray(kernel.preconditioning.scale))
    sup = np.asarray(kernel.subsample_bounds.sup)
    for m in range(4):
        rows = np.abs(X[owner == m]) * scale
        np.testing.assert_allclose(sup[m], np.sum(rows * rows.sum(1, keepdims=True), axis=0) / 0.25, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(kernel.subsample_bounds.prior), np.outer(scale, scale) * np.eye(3), rtol=1e-6)
    mean, sd = gaussian_posterior(X, y, 0.5)
    assert_agree_with_exact(np.asarray(mcmc.get_samples()["w"]), mean, sd)


def test_client_local_latents_agree_with_the_closed_form():
    """Per-client intercepts (client-local latents, each client's prior term estimated
    exactly, its rows subsampled) over unequal clients: the exact Gaussian posterior."""
    rng = np.random.default_rng(4)
    n = 160
    owner = unequal_owner(n, 4)
    X = rng.normal(size=(n, 2))
    y = X @ np.array([0.7, -0.4]) + np.array([-1.0, 0.0, 0.5, 1.0])[owner] + rng.normal(size=n)
    kernel, mcmc = run_zigzag(random_intercepts, (X, owner, y, owner), subsample_size=2, sample_interval=0.2)
    design = np.concatenate([np.eye(4)[owner], X], axis=1)  # the flat order: u, then w
    mean, sd = gaussian_posterior(design, y, 1.0)
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
    assert kernel.rows_per_gradient.tolist() == [6] * 4  # the batch and the client-level terms
    assert_agree_with_exact(flat(mcmc.get_samples(), ["u", "w"]), mean, sd)


@pytest.mark.slow
def test_poisson_regression_is_warned_counted_and_agrees_with_nuts():
    """A log link: the per-row curvature exp(a x) a a^T is not bounded; the automatic bound
    holds near the posterior, the run is warned at set-up, its violations counted (and
    reported by check_run if any), and the posterior is NUTS's."""
    rng = np.random.default_rng(5)
    n = 200
    X = 0.5 * rng.normal(size=(n, 2))
    y = rng.poisson(np.exp(X @ np.array([0.6, -0.4]) + 0.3)).astype(float)
    owner = unequal_owner(n, 5)
    with pytest.warns(RuntimeWarning, match="grows away from the posterior"):
        kernel, mcmc = run_zigzag(poisson, (X, y, owner), subsample_size=2, sample_interval=0.1)
    assert kernel.unbounded_curvature
    violations, proposals, _ = (
        kernel.check_run(mcmc)
        if int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
        else _checked(kernel, mcmc)
    )
    assert violations < 1e-3 * proposals
    reference = run_nuts(poisson, (X, y, owner))
    assert_agree_with_draws(flat(mcmc.get_samples(), ["b", "w"]), flat(reference, ["b", "w"]))


@pytest.mark.parametrize(
    "order, match",
    [
        ("first_order", "the curvature of client 0, client 1, client 2, client 3 grows away"),
        (None, "the rows' third derivative of client 0, client 1, client 2, client 3 grows away"),
    ],
)
def test_the_set_up_warning_names_what_grows(order, match):
    """A log link: the rows' curvature (what the first-order estimate's bound holds) and their
    third derivative (the second-order one's) both grow away from the posterior; the set-up
    warning names the one its bound rests on. The Normal priors' curvature is constant: not
    named."""
    rng = np.random.default_rng(5)
    X = 0.5 * rng.normal(size=(200, 2))
    y = rng.poisson(np.exp(X @ np.array([0.6, -0.4]) + 0.3)).astype(float)
    owner = unequal_owner(200, 5)
    with pytest.warns(RuntimeWarning, match=match):
        kernel, _ = run_zigzag(
            poisson, (X, y, owner), subsample_size=1, num_samples=5, num_warmup=5, control_variates=order
        )
    assert kernel.unbounded_curvature


def _checked(kernel, mcmc):
    with pytest.warns(RuntimeWarning, match="bound on the rows' curvature"):
        return kernel.check_run(mcmc)


def probit(X, y=None, clients=None):
    b = numpyro.sample("b", dist.Normal(0, 5).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(probs=jax.scipy.stats.norm.cdf(X @ b)), obs=y)


def test_curvature_not_finite_away_from_the_posterior_is_warned_not_refused():
    """A probit written with probabilities: one unit from the reference (covariates of scale
    50) Phi underflows and the rows' Hessians are nan. Near the posterior they are finite, so
    the run is warned (a local bound), counted, and agrees with NUTS; with the Laplace
    preconditioner (the covariates' scales differ 500-fold)."""
    rng = np.random.default_rng(8)
    X = rng.normal(size=(400, 3)) * np.array([1.0, 50.0, 0.1])
    y = (rng.uniform(size=400) < jax.scipy.stats.norm.cdf(X @ np.array([0.5, -0.01, 4.0]))).astype(float)
    owner = unequal_owner(400, 8)
    with pytest.warns(RuntimeWarning, match="is not finite one unit from the reference point"):
        kernel, mcmc = run_zigzag(
            probit, (X, y, owner), subsample_size=1, sample_interval=None, preconditioner="laplace"
        )
    assert kernel.unbounded_curvature
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
    assert_agree_with_draws(np.asarray(mcmc.get_samples()["b"]), np.asarray(run_nuts(probit, (X, y, owner))["b"]))


def test_a_violation_in_warmup_grows_the_bound():
    """A user bound too small for the model: the warmup's violations double it, with a
    warning, and the bound's growth stays in the state."""
    X, y, owner = logistic_data(200)
    small = nf.RowHessianBound(lambda x, *rest: jnp.abs(jnp.outer(x, x)) / 400.0, prior=jnp.eye(3))
    with pytest.warns(RuntimeWarning, match="had estimated rates above their bound"):
        kernel, mcmc = run_zigzag(
            logistic, (X, y, owner), subsample_size=1, bounds=small, num_warmup=30, num_samples=10
        )
    assert float(mcmc.last_state.bound_scale) >= 4.0


@pytest.mark.slow
@pytest.mark.parametrize("third", [None, logistic_third])
def test_user_row_bound_is_exact_for_logistic_regression(third):
    """RowHessianBound with logistic's |a_i a_k| / 4 per row (first order) or with its third
    derivative's bound too (second order): no violation, NUTS's posterior."""
    X, y, owner = logistic_data(200, seed=1)
    # the row arguments: X's row, y's, and the row's client (an argument with a row per row)
    bound = nf.RowHessianBound(lambda x, y, client: jnp.abs(jnp.outer(x, x)) / 4, prior=jnp.eye(3), third=third)
    kernel, mcmc = run_zigzag(logistic, (X, y, owner), subsample_size=1, bounds=bound)
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
    if third is None:
        # the clients' bound is the sum of |a_J a_J^T| / 4's row sums over the rows, the prior's the identity
        assert_importance_bound(kernel.subsample_bounds, X, owner, margin=1.0)
        np.testing.assert_allclose(np.asarray(kernel.subsample_bounds.prior), np.eye(3), atol=1e-12)
    else:  # the prior's term is bounded through twice its curvature
        assert kernel.subsample_bounds.second is not None
        np.testing.assert_allclose(np.asarray(kernel.subsample_bounds.prior), 2 * np.eye(3), atol=1e-12)
    assert_agree_with_draws(np.asarray(mcmc.get_samples()["w"]), np.asarray(run_nuts(logistic, (X, y, owner))["w"]))


# -- through a federation ----------------------------------------------------------------------


@pytest.mark.slow
def test_through_a_federation_and_in_deployment():
    """Algorithm 2 as messages (InProcess, each client thinning its own proposals, second
    order): the posterior of NUTS, the clients' weights in one set-up call each; deployment
    (each client loads its rows) gives the same draws."""
    X, y, owner = logistic_data(200, seed=2)
    fed_kernel, fed_mcmc = run_zigzag(
        logistic,
        (X, y, owner),
        subsample_size=2,
        federation=InProcess(),
        thinning="clients",
        num_samples=600,
        sample_interval=0.2,
    )
    ledger = fed_kernel.message_ledger(fed_mcmc)
    np.testing.assert_array_equal(ledger["row_remainders/messages_from_client"], [1, 1, 1, 1])
    assert int(fed_mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
    assert_agree_with_draws(np.asarray(fed_mcmc.get_samples()["w"]), np.asarray(run_nuts(logistic, (X, y, owner))["w"]))

    order = np.argsort(owner, kind="stable")
    sizes = np.bincount(owner)
    blocks = np.split(order, np.cumsum(sizes)[:-1])

    def load(m):
        return (X[blocks[m]], y[blocks[m]])

    def deployed_model(X, y=None):
        return logistic(X, y, clients=np.repeat(np.arange(4), sizes))

    sim_kernel, simulated = run_zigzag(
        deployed_model,
        (X[order], y[order]),
        subsample_size=2,
        federation=InProcess(),
        thinning="clients",
        num_samples=50,
        num_warmup=10,
    )
    dep_kernel, deployed = run_zigzag(
        deployed_model,
        (),
        subsample_size=2,
        federation=InProcess(loader=load, num_clients=4),
        thinning="clients",
        num_samples=50,
        num_warmup=10,
    )
    assert dep_kernel.federated_potential.deployed
    np.testing.assert_array_equal(np.asarray(deployed.get_samples()["w"]), np.asarray(simulated.get_samples()["w"]))


@pytest.mark.slow
def test_on_ray_agrees_with_in_process(ray_session):
    """The same run on Ray workers (each holding its rows) gives the in-process draws."""
    ray_federation = nf.RayFederation(timeout=120.0)
    X, y, owner = logistic_data(200, seed=6)
    _, local = run_zigzag(
        logistic,
        (X, y, owner),
        subsample_size=2,
        federation=InProcess(),
        thinning="clients",
        num_samples=100,
        num_warmup=10,
    )
    _, remote = run_zigzag(
        logistic, (X, y, owner), subsample_size=2, federation=ray_federation, num_samples=100, num_warmup=10
    )
    ray_federation.close()
    np.testing.assert_allclose(np.asarray(remote.get_samples()["w"]), np.asarray(local.get_samples()["w"]), rtol=1e-10)


# -- float32 and bad input ---------------------------------------------------------------------


def test_float32():
    """NumPyro's default dtype: the run stays in float32 and agrees with the closed form."""
    numpyro.enable_x64(False)
    try:
        rng = np.random.default_rng(7)
        X = rng.normal(size=(200, 3)).astype(np.float32)
        y = (X @ np.array([0.5, -0.2, 0.3]) + 0.5 * rng.normal(size=200)).astype(np.float32)
        owner = unequal_owner(200, 7)
        kernel, mcmc = run_zigzag(linear, (X, y, owner), subsample_size=2, sample_interval=0.05, num_samples=800)
        w = np.asarray(mcmc.get_samples()["w"])
        assert w.dtype == np.float32 and np.isfinite(w).all()
        assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
        mean, sd = gaussian_posterior(X.astype(np.float64), y.astype(np.float64), 0.5)
        assert_agree_with_exact(w.astype(np.float64), mean, sd)
    finally:
        numpyro.enable_x64(True)


@pytest.mark.parametrize(
    "size, error, match",
    [
        (0, ValueError, "subsample_size must be >= 1"),
        (-3, ValueError, "subsample_size must be >= 1"),
        (2.5, TypeError, "subsample_size must be an integer"),
    ],
)
def test_bad_subsample_size(size, error, match):
    with pytest.raises(error, match=match):
        nf.FedZigZag(logistic, subsample_size=size)


def test_subsample_larger_than_a_client_is_refused():
    X, y, owner = logistic_data(100)
    smallest = int(np.bincount(owner).min())
    kernel = nf.FedZigZag(logistic, subsample_size=smallest + 1)
    mcmc = MCMC(kernel, num_warmup=5, num_samples=5, progress_bar=False)
    with pytest.raises(ValueError, match=f"larger than client {int(np.argmin(np.bincount(owner)))}'s {smallest} rows"):
        mcmc.run(jax.random.PRNGKey(0), X, y, owner)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"dp_sensitivity": 2.0, "dp_epsilon": 1.0, "dp_delta": 1e-3}, "privacy guarantee"),
        ({"control_variates": False}, "control_variates=False"),
        ({"control_variates": "second_order", "bounds": nf.RowHessianBound(lambda x, y: jnp.eye(3))}, "third="),
        ({"bounds": "affine"}, "bounds at its default"),
        ({"bounds": nf.HessianBound(1.0)}, "bounds at its default"),
        ({"preconditioner": "laplace", "thinning": "clients"}, "not with the clients' thinning"),
    ],
)
def test_refused_combinations(options, match):
    """Subsampling with a DP guarantee (Theorem 5.1 does not cover estimated rates) and
    with settings it does not support: a clear error at construction."""
    with pytest.raises(ValueError, match=match):
        nf.FedZigZag(logistic, subsample_size=1, **options)


def test_row_bound_without_subsampling_and_row_local_latents_are_refused():
    with pytest.raises(ValueError, match="pass subsample_size"):
        nf.FedZigZag(logistic, bounds=nf.RowHessianBound(lambda x, y: jnp.eye(3)))

    def row_latents(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            eta = numpyro.sample("eta", dist.Normal(X @ w, 0.5))
            numpyro.sample("y", dist.Normal(eta, 1.0), obs=y)

    X = np.random.default_rng(0).normal(size=(20, 2))
    mcmc = MCMC(nf.FedZigZag(row_latents, subsample_size=1), num_warmup=5, num_samples=5, progress_bar=False)
    with pytest.raises(ValueError, match="'eta'.*one value per data row"):
        mcmc.run(jax.random.PRNGKey(0), X, X[:, 0])
