"""FedZigZag samples the right distribution: closed-form Gaussian posterior, NUTS on logistic regression."""

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed.metrics import marginal_w1

N, D, M = 50, 10, 5
PRIOR_SD = 100.0


def gaussian_mean(y, clients=M):
    mu = numpyro.sample("mu", dist.Normal(0, PRIOR_SD).expand([y.shape[1]]).to_event(1))
    with nf.federated_plate("data", y.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(mu, 1.0).to_event(1), obs=y)


def logistic(X, y=None, clients=4):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def _gaussian_data():
    # Section 6.1 of the Fed-PDMC paper: N = 50 draws of N(0.5, I_10), M = 5 clients.
    y = 0.5 + jax.random.normal(jax.random.PRNGKey(0), (N, D))
    precision = N + PRIOR_SD**-2
    return y, y.sum(0) / precision, 1 / np.sqrt(precision)


def _run(kernel, *args, num_samples=4000, seed=1, extra_fields=(), **kwargs):
    mcmc = MCMC(kernel, num_warmup=200, num_samples=num_samples, progress_bar=False)
    fields = ("info.num_events", "info.num_violations") + tuple(extra_fields)
    mcmc.run(jax.random.PRNGKey(seed), *args, extra_fields=fields, **kwargs)
    return mcmc


def _assert_gaussian_moments(draws, mean, sd):
    draws = np.asarray(draws)
    ess = effective_sample_size(draws[None])
    # 4.5 Monte Carlo standard errors over 10 coordinates: fails with probability < 1e-4
    assert np.all(np.abs(draws.mean(0) - mean) < 4.5 * sd / np.sqrt(ess)), (draws.mean(0) - mean) / sd
    assert np.all(np.abs(draws.std(0) / sd - 1) < 4.5 / np.sqrt(2 * ess))
    # off-diagonal correlations of the independent posterior coordinates vanish
    corr = np.corrcoef(draws.T)[np.triu_indices(draws.shape[1], 1)]
    assert np.all(np.abs(corr) < 4.5 / np.sqrt(ess.min()))


@pytest.mark.parametrize("control_variates", [False, True])
@pytest.mark.parametrize("prior", ["server", "clients"])
def test_gaussian_target_matches_closed_form(control_variates, prior):
    y, mean, sd = _gaussian_data()
    kernel = nf.FedZigZag(gaussian_mean, sample_interval=0.1, control_variates=control_variates, prior=prior)
    mcmc = _run(kernel, y)
    _assert_gaussian_moments(mcmc.get_samples()["mu"], mean, sd)
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0


def _prior_dominated(y, clients=1):
    x = numpyro.sample("x", dist.Normal(0.0, 1.0).expand([y.shape[1]]).to_event(1))
    with nf.federated_plate("data", y.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(x, 3.0).to_event(1), obs=y)


def test_every_proposer_thins_with_its_own_uniform():
    # One client and the prior as the server's proposer (proposer 1), the prior carrying most
    # of the posterior's curvature: a thinning test that reused the uniform which picked the
    # proposer's coordinate would accept low coordinates too often and high ones too rarely,
    # shifting the marginal variances by about 10 % (7 Monte Carlo errors here).
    y = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)))
    precision = 1 + y.shape[0] / 9.0
    mean, var = y.sum(0) / 9.0 / precision, 1 / precision
    kernel = nf.FedZigZag(_prior_dominated, sample_interval=0.5, control_variates=False)
    mcmc = _run(kernel, y, num_samples=40_000)
    draws = np.asarray(mcmc.get_samples()["x"])
    squares = (draws - mean) ** 2
    for values, target in ((draws, mean), (squares, var)):
        ess = effective_sample_size(values[None])
        z = (values.mean(0) - target) / (values.std(0) / np.sqrt(ess))
        assert np.all(np.abs(z) < 4.5), z  # 6 tests at 4.5 errors: fails with probability < 1e-4


def test_gaussian_target_with_prior_redistribution():
    y, mean, sd = _gaussian_data()

    # a visible prior (sd 1) so that its shares matter; rate 2 so that it is redrawn often
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0, 1.0).expand([D]).to_event(1))
        with nf.federated_plate("data", y.shape[0], clients=M):
            numpyro.sample("y", dist.Normal(mu, 1.0).to_event(1), obs=y)

    precision = N + 1.0
    for cv in (False, True):
        kernel = nf.FedZigZag(
            model, sample_interval=0.1, prior="redistribute", redistribution_rate=2.0, control_variates=cv
        )
        mcmc = _run(kernel, y)
        _assert_gaussian_moments(mcmc.get_samples()["mu"], y.sum(0) / precision, 1 / np.sqrt(precision))
        weights = np.asarray(mcmc.last_state.core.prior_weights)
        assert weights.shape == (M,) and abs(weights.sum() - 1) < 1e-12
        assert not np.allclose(weights, 1 / M)  # redrawn at least once


@pytest.mark.parametrize("excess_rate", [0.0, 20.0])
def test_affine_bounds_are_exact_on_the_gaussian_target(excess_rate):
    y, mean, sd = _gaussian_data()
    kernel = nf.FedZigZag(gaussian_mean, sample_interval=0.1, bounds="affine", excess_rate=excess_rate)
    mcmc = _run(kernel, y)
    _assert_gaussian_moments(mcmc.get_samples()["mu"], mean, sd)
    fields = mcmc.get_extra_fields()
    # exact inversion: every proposal is a switch, and no bound is ever exceeded
    np.testing.assert_array_equal(fields["info.num_events"], fields["info.num_proposals"])
    assert int(fields["info.num_violations"].sum()) == 0


def test_affine_bounds_on_a_non_gaussian_target_report_their_violations():
    key_x, key_y = jax.random.split(jax.random.PRNGKey(2))
    X = jax.random.normal(key_x, (200, 3))
    y = jax.random.bernoulli(key_y, jax.nn.sigmoid(X @ jnp.array([1.0, -1.0, 0.5]))) * 1.0
    mcmc = _run(nf.FedZigZag(logistic, sample_interval=0.2, bounds="affine"), X, y, num_samples=500)
    violations = int(mcmc.get_extra_fields()["info.num_violations"].sum())
    assert violations > 0  # the logistic rate is not affine along lines: it is checked
    with pytest.warns(RuntimeWarning, match=f"{violations} of"):
        nf.to_inference_data(mcmc)


def test_gaussian_target_with_refreshment():
    y, mean, sd = _gaussian_data()
    mcmc = _run(nf.FedZigZag(gaussian_mean, sample_interval=0.1, excess_rate=20.0), y)
    _assert_gaussian_moments(mcmc.get_samples()["mu"], mean, sd)


def test_control_variates_remove_spurious_switches():
    y, _, _ = _gaussian_data()
    events = {}
    for cv in (False, True):
        mcmc = _run(nf.FedZigZag(gaussian_mean, sample_interval=0.1, control_variates=cv), y, num_samples=500)
        events[cv] = int(mcmc.get_extra_fields()["info.num_events"].sum())
    # without control variates the federated rate carries an O(sqrt(NM)) excess
    assert events[True] < 0.7 * events[False]


def linear_regression(X, y, clients=12):
    w = numpyro.sample("w", dist.Normal(0, 10.0).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def test_second_order_control_variates_match_closed_form_without_spurious_switches():
    # 12 clients of 5 rows in 6 dimensions: the clients' curvatures X_m^T X_m point in
    # different directions, which first-order control variates cannot undo.
    key_x, key_y = jax.random.split(jax.random.PRNGKey(5))
    X = jax.random.normal(key_x, (60, 6))
    y = X @ jnp.linspace(-1.0, 1.0, 6) + jax.random.normal(key_y, (60,))
    precision = np.asarray(X.T @ X) + np.eye(6) / 100
    cov = np.linalg.inv(precision)
    mean, sd = cov @ np.asarray(X.T @ y), np.sqrt(np.diag(cov))
    events = {}
    for cv in (True, "second_order"):
        mcmc = _run(nf.FedZigZag(linear_regression, sample_interval=0.1, control_variates=cv), X, y, num_samples=2000)
        events[cv] = int(mcmc.get_extra_fields()["info.num_events"].sum())
    draws = np.asarray(mcmc.get_samples()["w"])
    ess = effective_sample_size(draws[None])
    assert np.all(np.abs(draws.mean(0) - mean) < 4.5 * sd / np.sqrt(ess))
    assert np.all(np.abs(draws.std(0) / sd - 1) < 4.5 / np.sqrt(2 * ess))
    # one proposer holding the whole potential: the rate no federation can go below
    single = _run(
        nf.FedZigZag(linear_regression, sample_interval=0.1, control_variates=False, prior="clients"),
        X,
        y,
        clients=1,
        num_samples=2000,
    )
    events["single"] = int(single.get_extra_fields()["info.num_events"].sum())
    # On a quadratic potential, second order gives every proposer exactly grad U / P, so the
    # federated rate is the single proposer's: the same switch count up to Poisson noise
    # (5 sd for the difference of two counts of about n), while first order keeps an excess
    # (about 35 % here; the margin below is about 7 sd).
    assert abs(events["second_order"] - events["single"]) < 5 * np.sqrt(2 * events["single"]), events
    assert events["second_order"] < 0.85 * events[True], events


def test_one_client_agrees_with_many_and_same_key_gives_same_chain():
    y, mean, sd = _gaussian_data()
    one = _run(nf.FedZigZag(gaussian_mean, sample_interval=0.1), y, clients=1).get_samples()["mu"]
    _assert_gaussian_moments(one, mean, sd)
    again = _run(nf.FedZigZag(gaussian_mean, sample_interval=0.1), y, clients=1).get_samples()["mu"]
    np.testing.assert_array_equal(one, again)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"sample_interval": 0.0}, ValueError, "sample_interval must be a finite number > 0"),
        ({"sample_interval": -1.0}, ValueError, "sample_interval must be a finite number > 0"),
        ({"excess_rate": -0.5}, ValueError, "excess_rate must be >= 0"),
        ({"grid_size": 1}, ValueError, "grid_size must be >= 2"),
        ({"bounds": "magic"}, ValueError, "bounds must be 'grid', 'affine', a GradientBound or a HessianBound"),
        ({"safety_factor": 0.5}, ValueError, "safety_factor must be >= 1"),
        ({"prior": "nowhere"}, ValueError, "prior must be one of"),
        (
            {"prior": "redistribute", "redistribution_rate": 0.0},
            ValueError,
            "redistribution_rate must be a finite number > 0",
        ),
        (
            {"control_variates": "third_order"},
            ValueError,
            "control_variates must be None, True, False, 'first_order' or 'second_order'",
        ),
        (
            {"control_variates": "second_order", "bounds": nf.GradientBound(np.ones(10))},
            ValueError,
            "'second_order' needs the automatic bounds",
        ),
        (
            {"control_variates": "second_order", "dp_sensitivity": 2.0, "dp_delta": 1e-5, "excess_rate": 1.0},
            ValueError,
            "not covered by Theorem 5.1",
        ),
    ],
)
def test_bad_hyper_parameters(kwargs, error, message):
    with pytest.raises(error, match=message):
        nf.FedZigZag(gaussian_mean, **kwargs)


def test_inference_data_has_per_client_diagnostics_and_attrs():
    y, _, _ = _gaussian_data()
    mcmc = _run(nf.FedZigZag(gaussian_mean, sample_interval=0.1), y, num_samples=300)
    idata = nf.to_inference_data(mcmc)
    stats = idata.sample_stats
    assert stats["events_by_client"].dims == ("chain", "draw", "client")
    assert stats["events_by_client"].shape == (1, 300, M)
    # every accepted switch is counted once, by the client or the server's prior proposer
    total = stats["events_by_client"].sum("client") + stats["events_by_prior"]
    np.testing.assert_array_equal(total, stats["num_events"])
    assert int(stats["num_proposals"].sum()) >= int(stats["num_events"].sum()) > 0
    assert idata.attrs["algorithm"] == "FedZigZag"
    assert idata.attrs["num_clients"] == M
    assert "privacy_epsilon" not in idata.attrs


def test_privacy_calibration_reported_per_message():
    from numpyro_fed.privacy import switching_time_delta

    y, mean, sd = _gaussian_data()
    kernel = nf.FedZigZag(gaussian_mean, sample_interval=0.1, dp_sensitivity=3.0, dp_epsilon=2.0, dp_delta=1e-4)
    # (7): rho = K (1 + log(1/delta)) / epsilon
    assert kernel.excess_rate == pytest.approx(3.0 * (1 + np.log(1e4)) / 2.0)
    assert kernel.privacy.epsilon <= 2.0
    assert switching_time_delta(3.0, kernel.excess_rate, 2.0) <= 1e-4
    assert "per message" in kernel.privacy.scope
    assert kernel.control_variates is False
    mcmc = _run(kernel, y, num_samples=300)
    idata = nf.to_inference_data(mcmc)
    assert idata.attrs["privacy_epsilon"] == pytest.approx(kernel.privacy.epsilon)
    assert idata.attrs["privacy_delta"] == 1e-4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dp_sensitivity": 2.0}, "dp_sensitivity needs dp_delta"),
        ({"dp_epsilon": 1.0, "dp_delta": 1e-5}, "need dp_sensitivity"),
        ({"dp_sensitivity": 2.0, "dp_delta": 1e-5}, "needs excess_rate > 0"),
        ({"dp_sensitivity": 0.5, "dp_delta": 1e-5, "excess_rate": 1.0}, "sensitivity K must be > 1"),
        ({"dp_sensitivity": 2.0, "dp_delta": 1.5, "excess_rate": 1.0}, r"delta must lie in \(0, 1\)"),
        ({"dp_sensitivity": 2.0, "dp_epsilon": -1.0, "dp_delta": 1e-5}, "dp_epsilon must be a finite number > 0"),
        ({"dp_sensitivity": 2.0, "dp_epsilon": 1.0, "dp_delta": 1e-5, "excess_rate": 1.0}, "above dp_epsilon=1.0"),
        (
            {"dp_sensitivity": 2.0, "dp_epsilon": 1.0, "dp_delta": 1e-5, "control_variates": True},
            "not covered by Theorem 5.1",
        ),
    ],
)
def test_bad_privacy_requests(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nf.FedZigZag(gaussian_mean, **kwargs)


def test_client_local_latents_agree_with_nuts():
    from models import hierarchical

    # Random effects identified by the data (200 rows, separated groups), so that the
    # posterior has no funnel and NUTS is a trustworthy reference (checked: no divergences).
    rng = np.random.default_rng(5)
    owner = rng.choice(4, size=200, p=[0.1, 0.2, 0.3, 0.4])
    X = rng.normal(size=(200, 3))
    y = X @ np.array([0.5, -0.5, 0.0]) + np.array([-1.0, -0.3, 0.4, 1.2])[owner] + 0.5 * rng.normal(size=200)
    args = (jnp.asarray(X), jnp.asarray(owner), jnp.asarray(y))
    nuts = MCMC(NUTS(hierarchical), num_warmup=1000, num_samples=4000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(0), *args, clients=owner, extra_fields=("diverging",))
    assert int(nuts.get_extra_fields()["diverging"].sum()) == 0
    zigzag = _run(nf.FedZigZag(hierarchical, sample_interval=0.3), *args, clients=owner, num_samples=4000)
    for site in ("mu", "tau", "u", "sigma_c", "w"):
        reference = np.asarray(nuts.get_samples()[site]).reshape(4000, -1)
        draws = np.asarray(zigzag.get_samples()[site]).reshape(4000, -1)
        # Monte Carlo error of a W1 between two independent samples: both samples' errors add;
        # NUTS's ESS can exceed its draw count (anticorrelation), the empirical law's noise cannot.
        ess_zigzag = effective_sample_size(draws[None])
        ess_nuts = np.minimum(effective_sample_size(reference[None]), len(reference))
        scale = reference.std(0)
        tolerance = 5 * scale * np.sqrt(1 / ess_zigzag + 1 / ess_nuts)
        assert np.all(marginal_w1(draws, reference) < tolerance), site
    assert int(zigzag.get_extra_fields()["info.num_violations"].sum()) < 10


def test_exact_trajectory_moments_and_skeleton():
    y, mean, sd = _gaussian_data()
    kernel = nf.FedZigZag(gaussian_mean, sample_interval=0.1, skeleton_size=64, full_covariance=True)
    mcmc = _run(kernel, y)
    moments = kernel.trajectory_moments(mcmc)
    draws = np.asarray(mcmc.get_samples()["mu"])
    ess = effective_sample_size(draws[None])
    # the path average is at least as accurate as the draws' average
    assert np.all(np.abs(moments["mean"] - mean) < 4.5 * sd / np.sqrt(ess))
    np.testing.assert_allclose(np.sqrt(np.diag(moments["cov"])) / sd, 1, atol=4.5 / np.sqrt(2 * ess.min()))
    offdiag = moments["cov"][np.triu_indices(D, 1)] / sd**2
    assert np.all(np.abs(offdiag) < 4.5 / np.sqrt(ess.min()))

    times, xs, vs = kernel.skeleton(mcmc)
    assert len(times) == int(mcmc.get_extra_fields()["info.num_events"].sum())
    assert np.all(np.diff(times) > 0)
    # between two switches the path is straight: x_{k+1} = x_k + (t_{k+1} - t_k) v_k
    np.testing.assert_allclose(xs[1:], xs[:-1] + np.diff(times)[:, None] * vs[:-1], atol=1e-9)
    # and each switch flips exactly one coordinate of the velocity
    assert np.all((vs[1:] != vs[:-1]).sum(1) == 1)

    import matplotlib

    matplotlib.use("Agg")
    from numpyro_fed.plots import plot_zigzag_trajectory

    ax = plot_zigzag_trajectory(times[:200], xs[:200], coords=(0, 1))
    assert len(ax.get_lines()[0].get_xydata()) == 200


class _RecordedRun:
    """Stands in for an MCMC run with given diagnostics (to test the reporting alone)."""

    def __init__(self, violations, proposals, capped):
        self.fields = {
            "info.num_violations": jnp.array(violations),
            "info.num_proposals": jnp.array(proposals),
            "info.hit_event_cap": jnp.array(capped),
        }

    def get_extra_fields(self):
        return self.fields

    def get_samples(self, group_by_chain=False):
        return {}  # no draws: the effective-sample check has nothing to say


def test_bound_violations_and_event_cap_are_reported():
    kernel = nf.FedZigZag(gaussian_mean, max_proposals=10)
    assert kernel.check_run(_RecordedRun([0, 0], [5, 7], [False, False])) == (0, 12, 0)
    with pytest.warns(RuntimeWarning, match="3 of 12 proposals had an exact rate above its automatic bound"):
        kernel.check_run(_RecordedRun([1, 2], [5, 7], [False, False]))
    with pytest.raises(RuntimeError, match=r"1 samples stopped at max_proposals=10"):
        kernel.check_run(_RecordedRun([0, 0], [10, 7], [True, False]), strict=True)


def test_event_cap_is_hit_and_reported_in_a_real_run():
    y, _, _ = _gaussian_data()
    kernel = nf.FedZigZag(gaussian_mean, sample_interval=1.0, max_proposals=5)
    mcmc = _run(kernel, y, num_samples=20)
    with pytest.warns(RuntimeWarning, match="stopped at max_proposals=5"):
        nf.to_inference_data(mcmc)


# -- user-supplied bounds (Appendices A and F) ----------------------------------------------


def _gaussian_hessian_bound(y, clients=M):
    sizes = np.bincount(np.arange(len(y)) * clients // len(y), minlength=clients)
    return nf.HessianBound(clients=sizes[:, None, None] * np.eye(y.shape[1]), prior=np.eye(y.shape[1]) / PRIOR_SD**2)


@pytest.mark.parametrize("control_variates", [False, True])
def test_hessian_bound_on_the_gaussian_target_matches_closed_form(control_variates):
    y, mean, sd = _gaussian_data()
    kernel = nf.FedZigZag(
        gaussian_mean, sample_interval=0.1, control_variates=control_variates, bounds=_gaussian_hessian_bound(y)
    )
    mcmc = _run(kernel, y, extra_fields=("info.num_proposals", "info.grad_evals_by_proposer"))
    _assert_gaussian_moments(mcmc.get_samples()["mu"], mean, sd)
    fields = mcmc.get_extra_fields()
    assert int(fields["info.num_violations"].sum()) == 0
    evals = int(fields["info.grad_evals_by_proposer"].sum())
    proposals = int(fields["info.num_proposals"].sum())
    if control_variates:  # no gradient to propose: only each proposal's winner evaluates
        assert evals == proposals
    else:  # every proposer (M clients, the prior) once per line, i.e. after every switch (a
        # rejection or a sample keeps the line and its bound), plus each proposal's winner
        events = int(fields["info.num_events"].sum())
        assert evals == events * (M + 1) + proposals


def _logistic_data():
    key_x, key_y = jax.random.split(jax.random.PRNGKey(2))
    X = jax.random.normal(key_x, (300, 3))
    y = jax.random.bernoulli(key_y, jax.nn.sigmoid(X @ jnp.array([1.0, -1.0, 0.5]))) * 1.0
    owner = np.repeat(np.arange(4), [20, 50, 100, 130])
    np.random.default_rng(0).shuffle(owner)
    return X, y, owner


@pytest.fixture(scope="module")
def logistic_nuts():
    X, y, owner = _logistic_data()
    nuts = MCMC(NUTS(logistic), num_warmup=500, num_samples=4000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(0), X, y, clients=owner)
    return np.asarray(nuts.get_samples()["w"])


def _assert_agrees_with(draws, reference):
    draws = np.asarray(draws)
    ref_sd = reference.std(0)
    ess = effective_sample_size(draws[None])
    # W1 between two samples of a near-Gaussian marginal: O(sd / sqrt(ess)); 5x is a loose
    # but failing-on-bias bound (a shifted mean or wrong spread of 0.3 sd fails it).
    assert np.all(marginal_w1(draws, reference) < 5 * ref_sd / np.sqrt(ess))
    assert np.all(np.abs(draws.std(0) / ref_sd - 1) < 5 / np.sqrt(2 * ess))


@pytest.mark.parametrize("control_variates", [False, True, "second_order"])
def test_logistic_regression_over_unequal_clients_agrees_with_nuts(logistic_nuts, control_variates):
    X, y, owner = _logistic_data()
    mcmc = _run(nf.FedZigZag(logistic, sample_interval=0.2, control_variates=control_variates), X, y, clients=owner)
    _assert_agrees_with(mcmc.get_samples()["w"], logistic_nuts)


@pytest.mark.parametrize("control_variates", [False, True])
def test_hessian_bound_on_logistic_regression_agrees_with_nuts(logistic_nuts, control_variates):
    X, y, owner = _logistic_data()
    # each client bounds its own Hessian from its own rows: sum_r |x_r| |x_r|^T / 4
    absolute = np.abs(np.asarray(X))
    clients = np.stack([absolute[owner == m].T @ absolute[owner == m] / 4 for m in range(4)])
    kernel = nf.FedZigZag(
        logistic,
        sample_interval=0.2,
        control_variates=control_variates,
        bounds=nf.HessianBound(clients=clients, prior=np.eye(3)),
    )
    mcmc = _run(kernel, X, y, clients=owner, extra_fields=("info.num_proposals",))
    _assert_agrees_with(mcmc.get_samples()["w"], logistic_nuts)
    fields = mcmc.get_extra_fields()
    assert int(fields["info.num_violations"].sum()) == 0
    # a real bound, above the rate: some proposals are thinned away
    assert 0 < int(fields["info.num_events"].sum()) < int(fields["info.num_proposals"].sum())


def robust_location(y, clients=4):
    # Student-t likelihood and prior: every gradient is bounded (Appendix F.3's setting)
    mu = numpyro.sample("mu", dist.StudentT(3.0, 0.0, 10.0))
    with nf.federated_plate("data", y.shape[0], clients=clients):
        numpyro.sample("y", dist.StudentT(3.0, mu, 1.0), obs=y)


def _student_t_gradient_bound(nu, scale):
    # |d/dmu (nu + 1)/2 log(1 + (y - mu)^2 / (nu s^2))| <= (nu + 1) / (2 s sqrt(nu))
    return (nu + 1) / (2 * scale * np.sqrt(nu))


def test_gradient_bound_agrees_with_nuts_and_too_small_a_bound_is_reported():
    y = 2.0 + jax.random.t(jax.random.PRNGKey(3), 3.0, (200,))
    nuts = MCMC(NUTS(robust_location), num_warmup=500, num_samples=4000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(0), y)
    reference = np.asarray(nuts.get_samples()["mu"])[:, None]
    per_row = _student_t_gradient_bound(3.0, 1.0)
    bound = nf.GradientBound(clients=np.full((4, 1), 50 * per_row), prior=_student_t_gradient_bound(3.0, 10.0))
    for cv in (False, True):
        mcmc = _run(
            nf.FedZigZag(robust_location, sample_interval=0.2, bounds=bound, control_variates=cv),
            y,
            extra_fields=("info.num_proposals", "info.grad_evals_by_proposer"),
        )
        _assert_agrees_with(np.asarray(mcmc.get_samples()["mu"])[:, None], reference)
        fields = mcmc.get_extra_fields()
        assert int(fields["info.num_violations"].sum()) == 0
        # constant bounds: only each proposal's winner evaluates a gradient
        assert int(fields["info.grad_evals_by_proposer"].sum()) == int(fields["info.num_proposals"].sum())
    # a "bound" far below the clients' gradients is exceeded, and the run says so
    wrong = nf.GradientBound(clients=np.full((4, 1), 0.02 * per_row), prior=0.001)
    mcmc = _run(nf.FedZigZag(robust_location, sample_interval=0.2, bounds=wrong), y, num_samples=500)
    with pytest.warns(RuntimeWarning, match="above its GradientBound: it is not a bound for this model"):
        nf.to_inference_data(mcmc)


@pytest.mark.parametrize(
    "bounds, message",
    [
        (nf.HessianBound(clients=np.ones((3, D, D))), r"HessianBound.clients must broadcast to \(5, 10, 10\)"),
        (nf.HessianBound(clients=1.0, prior=-np.eye(D)), "HessianBound.prior must be finite and >= 0"),
        (nf.GradientBound(clients=np.full((M, D), np.nan)), "GradientBound.clients must be finite and >= 0"),
    ],
)
def test_bad_user_bounds_are_named(bounds, message):
    y, _, _ = _gaussian_data()
    mcmc = MCMC(nf.FedZigZag(gaussian_mean, bounds=bounds), num_warmup=0, num_samples=5, progress_bar=False)
    with pytest.raises(ValueError, match=message):
        mcmc.run(jax.random.PRNGKey(0), y)


# -- NumPyro's MCMC conveniences ------------------------------------------------------------


def test_warmup_then_run_and_post_warmup_state_continue_the_chain():
    y, mean, sd = _gaussian_data()
    mcmc = MCMC(nf.FedZigZag(gaussian_mean, sample_interval=0.1), num_warmup=100, num_samples=2000, progress_bar=False)
    mcmc.warmup(jax.random.PRNGKey(0), y)
    warm = mcmc.post_warmup_state
    mcmc.run(warm.rng_key, y)
    first = np.asarray(mcmc.get_samples()["mu"])
    _assert_gaussian_moments(first, mean, sd)
    # continuing from the last state with a new key gives a different, still correct chain
    mcmc.post_warmup_state = mcmc.last_state
    mcmc.run(jax.random.PRNGKey(7), y)
    second = np.asarray(mcmc.get_samples()["mu"])
    assert not np.allclose(first, second)
    _assert_gaussian_moments(second, mean, sd)


def test_vectorized_chains():
    y, mean, sd = _gaussian_data()
    mcmc = MCMC(
        nf.FedZigZag(gaussian_mean, sample_interval=0.1),
        num_warmup=100,
        num_samples=1000,
        num_chains=4,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(0), y, extra_fields=("info.num_events",))
    draws = mcmc.get_samples(group_by_chain=True)["mu"]
    assert draws.shape == (4, 1000, D)
    assert not np.allclose(draws[0], draws[1])
    _assert_gaussian_moments(np.asarray(draws).reshape(-1, D), mean, sd)
    idata = nf.to_inference_data(mcmc)
    assert idata.sample_stats["events_by_client"].shape == (4, 1000, M)
    assert float(idata.sample_stats["num_events"].min()) >= 0


# -- preconditioning ------------------------------------------------------------------------


def correlated_gaussian(y, clients=4):
    # a strongly correlated and badly scaled 3-d posterior: x ~ N(0, S) prior, y_r ~ N(A x, I)
    x = numpyro.sample("x", dist.Normal(0, 10.0).expand([3]).to_event(1))
    mixing = jnp.array([[1.0, 0.95, 0.0], [0.0, 1.0, 0.95], [0.0, 0.0, 0.2]])
    with nf.federated_plate("data", y.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(mixing @ x, 1.0).to_event(1), obs=y)


def _correlated_posterior(y):
    mixing = np.array([[1.0, 0.95, 0.0], [0.0, 1.0, 0.95], [0.0, 0.0, 0.2]])
    precision = len(y) * mixing.T @ mixing + np.eye(3) / 100
    cov = np.linalg.inv(precision)
    return cov @ mixing.T @ np.asarray(y).sum(0), cov


@pytest.mark.parametrize("preconditioner", ["laplace", "diagonal", "matrix"])
def test_preconditioned_sampler_matches_closed_form(preconditioner):
    y = jax.random.normal(jax.random.PRNGKey(4), (40, 3)) + 1.0
    mean, cov = _correlated_posterior(y)
    scale = np.linalg.cholesky(cov) * 1.3 if preconditioner == "matrix" else preconditioner
    kernel = nf.FedZigZag(correlated_gaussian, sample_interval=1.0, preconditioner=scale, full_covariance=True)
    mcmc = _run(kernel, y, num_samples=3000)
    draws = np.asarray(mcmc.get_samples()["x"])
    ess = effective_sample_size(draws[None])
    sd = np.sqrt(np.diag(cov))
    assert np.all(np.abs(draws.mean(0) - mean) < 4.5 * sd / np.sqrt(ess))
    assert np.all(np.abs(draws.std(0) / sd - 1) < 4.5 / np.sqrt(2 * ess))
    # the exact path moments are reported in the model's coordinates too
    moments = kernel.trajectory_moments(mcmc)
    assert np.all(np.abs(moments["mean"] - mean) < 4.5 * sd / np.sqrt(ess))
    np.testing.assert_allclose(np.sqrt(np.diag(moments["cov"])) / sd, 1, atol=4.5 / np.sqrt(2 * ess.min()))
    if preconditioner == "laplace":  # whitened: ESS close to the draw count at this spacing
        assert ess.min() > 1000


def test_laplace_preconditioning_speeds_up_a_correlated_posterior():
    y = jax.random.normal(jax.random.PRNGKey(4), (40, 3)) + 1.0
    events_per_ess = {}
    for preconditioner in (None, "laplace"):
        kernel = nf.FedZigZag(correlated_gaussian, sample_interval=1.0, preconditioner=preconditioner)
        mcmc = _run(kernel, y, num_samples=2000)
        ess = effective_sample_size(np.asarray(mcmc.get_samples()["x"])[None]).min()
        events_per_ess[preconditioner] = int(mcmc.get_extra_fields()["info.num_events"].sum()) / ess
    assert events_per_ess["laplace"] < events_per_ess[None] / 3, events_per_ess


def raw_covariate_regression(x, y, clients=4):
    """A regression as written on raw data: covariates in their units (scales 1 and 100, so
    coefficient sds 1000 times apart), a HalfCauchy noise scale."""
    alpha = numpyro.sample("alpha", dist.Normal(0, 100))
    beta = numpyro.sample("beta", dist.Normal(0, 10).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(5))
    with nf.federated_plate("data", y.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(alpha + x @ beta, sigma), obs=y)


def test_default_mixes_on_raw_covariates_as_nuts_does():
    """The default preconditioner ("auto": the Laplace approximation at the mode) makes a
    badly scaled posterior mix: at least 200 effective draws of 1000 on every coordinate, and
    NUTS's moments (within 4.5 Monte Carlo errors of the two chains together)."""
    rng = np.random.default_rng(3)
    x = np.stack([rng.normal(5.0, 1.0, 200), rng.normal(300.0, 100.0, 200)], axis=1)
    y = 2.0 + x @ np.array([0.5, 0.01]) + rng.normal(0, 1.0, 200)
    kernel = nf.FedZigZag(raw_covariate_regression)
    mcmc = MCMC(kernel, num_warmup=500, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), x, y)
    assert kernel.preconditioning is not None
    nuts = MCMC(NUTS(raw_covariate_regression), num_warmup=500, num_samples=2000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(1), x, y)
    for name in ("alpha", "beta", "sigma"):
        ours, ref = np.asarray(mcmc.get_samples()[name]), np.asarray(nuts.get_samples()[name])
        ess = effective_sample_size(ours.reshape(1, ours.shape[0], -1))
        assert ess.min() >= 200, (name, ess)
        se = np.sqrt(ours.reshape(len(ours), -1).var(0) / ess + ref.reshape(len(ref), -1).var(0) / 500)
        assert np.all(np.abs(ours.reshape(len(ours), -1).mean(0) - ref.reshape(len(ref), -1).mean(0)) < 4.5 * se), name


def test_default_preconditioner_steps_aside_where_the_posterior_has_no_mode():
    """A funnel (a hierarchical scale with client-local effects) has no mode: the default runs
    without a preconditioner, as ``preconditioner=None`` does, where ``"laplace"`` refuses."""
    y = jnp.array([0.3, -0.2, 0.1, 0.4])

    def funnel(y):
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with nf.federated_plate("groups", 4, clients=2):
            theta = numpyro.sample("theta", dist.Normal(0.0, tau))
            numpyro.sample("y", dist.Normal(theta, 1.0), obs=y)

    kernel = nf.FedZigZag(funnel)
    mcmc = MCMC(kernel, num_warmup=50, num_samples=50, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mcmc.run(jax.random.PRNGKey(0), y)
    assert not kernel.mode_search.is_mode and kernel.preconditioning is None
    with pytest.raises(ValueError, match="the posterior has no mode|has none here"):
        MCMC(nf.FedZigZag(funnel, preconditioner="laplace"), num_warmup=5, num_samples=5, progress_bar=False).run(
            jax.random.PRNGKey(0), y
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preconditioner": "magic"}, "preconditioner must be 'auto', None, 'laplace', 'diagonal' or an array"),
        (
            {"preconditioner": "laplace", "dp_sensitivity": 2.0, "dp_delta": 1e-5, "excess_rate": 1.0},
            "not covered by Theorem 5.1",
        ),
    ],
)
def test_bad_preconditioner_requests(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nf.FedZigZag(gaussian_mean, **kwargs)


def test_bad_preconditioner_shape_is_named():
    y, _, _ = _gaussian_data()
    mcmc = MCMC(nf.FedZigZag(gaussian_mean, preconditioner=np.ones(3)), num_warmup=0, num_samples=5, progress_bar=False)
    with pytest.raises(ValueError, match=r"preconditioner must have shape \(10,\) or \(10, 10\)"):
        mcmc.run(jax.random.PRNGKey(0), y)


def test_core_client_functions_add_up_to_the_potential_and_the_kernel_is_pure():
    """The seam a transport will sit on: what each client computes from its own rows, summed
    by the server with the prior, is the potential's gradient; and the core's kernel is a
    pure function of its key and state (documented info, nothing kept between calls)."""
    from numpyro_fed.infer import zigzag

    X, y, owner = _logistic_data()
    potential = nf.split_potential(logistic, (X, y), {"clients": owner})
    proposers, weights = zigzag.proposers_from_potential(potential, prior="server")
    x = jnp.linspace(-1.0, 1.0, X.shape[1])
    full = potential.ravel(potential.grad(potential.unravel(x)))
    prior_grad = proposers.prior_grad_and_slope(x, jnp.zeros_like(x))[0]
    np.testing.assert_allclose(proposers.term_grads(x).sum(0) + prior_grad, full, rtol=1e-10)
    kernel = jax.jit(zigzag.build_kernel(proposers, excess_rates=jnp.full(proposers.num, 0.5)))
    state = zigzag.init(x, jax.random.PRNGKey(0), weights)
    new, info = kernel(jax.random.PRNGKey(1), state, 2.0)
    again, info_again = kernel(jax.random.PRNGKey(1), state, 2.0)
    np.testing.assert_array_equal(new.x, again.x)
    assert float(info.elapsed) == pytest.approx(2.0)
    assert int(info.events_by_proposer.sum()) == int(info.num_events) <= int(info.num_proposals)
    other, _ = kernel(jax.random.PRNGKey(2), state, 2.0)
    assert not np.allclose(new.x, other.x)


def _mean_model(y):
    mu = numpyro.sample("mu", dist.Normal(0, 10))
    with nf.federated_plate("data", y.shape[0], clients=4):
        numpyro.sample("y", dist.Normal(mu, 1), obs=y)


def test_subsampling_and_deployment_on_the_mean_of_a_normal():
    """Subsampling reads one row of the winning client per check (here 25 rows each) and
    agrees with the posterior mean; in deployment each client loads its own rows and ``run``
    takes no data."""
    from numpyro_fed.federation import InProcess

    y = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (100,))
    sampler = nf.FedZigZag(_mean_model, sample_interval=0.2, subsample_size=1)
    mcmc = MCMC(sampler, num_warmup=50, num_samples=500, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), y)
    assert abs(float(mcmc.get_samples()["mu"].mean() - y.sum() / (100 + 0.01))) < 0.1
    assert sampler.rows_per_gradient.tolist() == [2, 2, 2, 2]
    assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0

    def load(m):
        return (y[25 * m : 25 * (m + 1)],)

    sampler = nf.FedZigZag(_mean_model, sample_interval=0.2, federation=InProcess(loader=load, num_clients=4))
    mcmc = MCMC(sampler, num_warmup=50, num_samples=200, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1))
    assert sampler.federated_potential.deployed
    assert mcmc.get_samples()["mu"].shape == (200,)
