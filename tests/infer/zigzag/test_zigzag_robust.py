"""FedZigZag with default settings on models nobody tuned it for: a funnel, float32, a stall."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.handlers import reparam
from numpyro.infer import MCMC, NUTS
from numpyro.infer.reparam import LocScaleReparam

import numpyro_fed as nf

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir)  # the repository


def funnel(x, client, y=None):
    """Per-client random intercepts, centered, with labels that barely identify them: the
    posterior of (tau, a) is a funnel and has no mode in the unconstrained space."""
    mu = numpyro.sample("mu", dist.Normal(0, 1))
    tau = numpyro.sample("tau", dist.HalfNormal(1))
    b = numpyro.sample("b", dist.Normal(0, 1))
    with nf.federated_plate("clients", 4, clients=4):
        a = numpyro.sample("a", dist.Normal(mu, tau))
    with nf.federated_plate("data", 200, clients=4):
        numpyro.sample("y", dist.Bernoulli(logits=a[client] + 0.1 * b * x), obs=y)


def funnel_data():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(k1, (200,))
    y = jax.random.bernoulli(k2, 0.5, (200,)) * 1.0
    return x, jnp.repeat(jnp.arange(4), 50), y


# With this key the mode search starts where BFGS walks down the funnel's neck (log tau about
# -7.6): control variates centered there made every draw exhaust max_proposals without one switch.
FUNNEL_KEY = 2


def test_funnel_has_no_mode_and_the_default_run_does_not_stall():
    data = funnel_data()
    kernel = nf.FedZigZag(funnel, max_proposals=20_000)
    mcmc = MCMC(kernel, num_warmup=20, num_samples=20, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(jax.random.PRNGKey(FUNNEL_KEY), *data, extra_fields=("info.num_events", "info.hit_event_cap"))
    fields = mcmc.get_extra_fields()
    assert not bool(fields["info.hit_event_cap"].any()), fields["info.num_events"]
    # the process moves: the adapted interval is a few of the smallest posterior sds, a few
    # switches per draw, so a draw without one happens without a stall (that is hit_event_cap)
    assert float((fields["info.num_events"] > 0).mean()) >= 0.5
    assert not kernel.mode_search.is_mode  # the search reports the funnel instead of using its neck
    # the control variates were re-centered on the second half of the warmup trajectory, off
    # the neck; the end-of-warmup comparison then keeps them, or turns them off and says so
    # (with 20 warmup draws either happens: keys 0 and 1 turn them off, before and after the
    # core took named keys)
    adapt = mcmc.last_state.adapt
    assert float(jnp.abs(adapt.reference.point - kernel.mode_search.point)[-1]) > 2  # left the neck
    turned_off = [w for w in caught if "turned off at the end of the warmup" in str(w.message)]
    assert bool(adapt.active) != bool(turned_off)


def _mean_agreement(a, b):
    """``|mean(a) - mean(b)|`` in units of the Monte Carlo error of the difference, per
    coordinate (each chain's error from its own effective sample size)."""
    a, b = np.asarray(a).reshape(len(a), -1), np.asarray(b).reshape(len(b), -1)
    error = np.sqrt(a.var(0) / effective_sample_size(a[None]) + b.var(0) / effective_sample_size(b[None]))
    return np.abs(a.mean(0) - b.mean(0)) / error


@pytest.mark.slow
def test_funnel_default_run_agrees_with_nuts():
    data = funnel_data()
    mcmc = MCMC(nf.FedZigZag(funnel), num_warmup=300, num_samples=3000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(FUNNEL_KEY), *data, extra_fields=("info.hit_event_cap",))
    assert not bool(mcmc.get_extra_fields()["info.hit_event_cap"].any())
    # NUTS needs the non-centered funnel; the reparametrization leaves the posterior unchanged
    reference = MCMC(
        NUTS(reparam(funnel, config={"a": LocScaleReparam(0)})),
        num_warmup=1000,
        num_samples=2000,
        num_chains=2,
        chain_method="sequential",
        progress_bar=False,
    )
    reference.run(jax.random.PRNGKey(0), *data)
    fed, nuts = mcmc.get_samples(), reference.get_samples()
    for name in ("mu", "tau", "b", "a"):
        # 9 quantities at 4.5 Monte Carlo errors each: a false failure has probability < 1e-4
        z = _mean_agreement(fed[name], nuts[name])
        assert np.all(z < 4.5), (name, z)
    # the scale's spread as well (its sd from FedZigZag within 15 % of NUTS's: about 4
    # Monte Carlo errors of an sd estimated from a few hundred effective draws)
    assert abs(float(fed["tau"].std()) / float(nuts["tau"].std()) - 1) < 0.15


def _gaussian(y):
    mu = numpyro.sample("mu", dist.Normal(0, 10).expand([2]).to_event(1))
    with nf.federated_plate("data", y.shape[0], clients=2):
        numpyro.sample("y", dist.Normal(mu, 1).to_event(1), obs=y)


def test_a_stalled_chain_stops_and_says_so():
    # A (valid but absurdly loose) gradient bound: about one switch per million proposals, so
    # a draw ends at max_proposals without a switch. The chain must not repeat that silently.
    y = jax.random.normal(jax.random.PRNGKey(0), (20, 2))
    kernel = nf.FedZigZag(
        _gaussian, bounds=nf.GradientBound(clients=1e7, prior=1e7), control_variates=False, max_proposals=200
    )
    mcmc = MCMC(kernel, num_warmup=0, num_samples=5, progress_bar=False)
    with pytest.warns(RuntimeWarning, match="stalled at draw 0.*control_variates=False") as caught:
        mcmc.run(jax.random.PRNGKey(1), y, extra_fields=("info.num_proposals", "info.hit_event_cap"))
    # raised from a host callback inside the compiled loop, it still names the user's line
    assert {os.path.basename(w.filename) for w in caught} == {os.path.basename(__file__)}
    fields = mcmc.get_extra_fields()
    assert fields["info.num_proposals"].tolist() == [200, 0, 0, 0, 0]  # stopped after the stall
    assert bool(fields["info.hit_event_cap"].all())
    with pytest.raises(RuntimeError, match="5 samples stopped at max_proposals"):
        kernel.check_run(mcmc, strict=True)


def test_control_variates_stay_on_where_they_change_nothing():
    # One client and a flat prior (the Gaussian of Fed-PDMC's Section 6.1): the shifted
    # gradient is the client's own, so the rates with and without control variates tie;
    # round-off must not turn them off with a warning (it did, before the margin).
    y = jax.random.normal(jax.random.PRNGKey(0), (50, 3)) + 0.5

    def model(y):
        mu = numpyro.sample("mu", dist.ImproperUniform(dist.constraints.real, (), (3,)))
        with nf.federated_plate("data", y.shape[0], clients=1):
            numpyro.sample("y", dist.Normal(mu, 1).to_event(1), obs=y)

    kernel = nf.FedZigZag(model, bounds="affine", sample_interval=0.05, control_variates=True)
    mcmc = MCMC(kernel, num_warmup=200, num_samples=10, num_chains=5, chain_method="vectorized", progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # 10 draws are too few to summarize (the end of the run says so); nothing else may warn
        warnings.filterwarnings("ignore", message=".*effective draws")
        mcmc.run(jax.random.PRNGKey(1), y)
    assert bool(jnp.all(mcmc.last_state.adapt.active))


def _run_float32(code: str, timeout: float = 600):
    """Runs ``code`` in a fresh interpreter (the tests enable float64; users get float32) with
    every warning an error, and returns what it printed as JSON on its last line."""
    env = dict(os.environ, JAX_ENABLE_X64="0", PYTHONPATH=os.path.abspath(ROOT))
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_float32_mode_search_is_one_bfgs_run_and_silent():
    # The README's model in float32: the mode's test is statistical (a Newton step of at most
    # 0.05 posterior sd), which float32 meets at once; it used to ask for |grad U| < 1e-6 (1 + |U|),
    # restart BFGS 20 times and warn.
    result = _run_float32("""
        import json, warnings, jax, numpyro, numpyro.distributions as dist
        from numpyro.infer import MCMC
        import numpyro_fed as nf
        # 20 draws are too few to summarize, and the end of the run says so: not the set-up
        warnings.filterwarnings("ignore", message=".*effective draws")
        def model(X, y=None):
            w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
            with nf.federated_plate("data", X.shape[0], clients=4):
                numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        X = jax.random.normal(jax.random.PRNGKey(0), (400, 3)); y = (X[:, 0] > 0) * 1.0
        kernel = nf.FedZigZag(model, sample_interval=0.5)
        mcmc = MCMC(kernel, num_warmup=10, num_samples=20, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(2), X, y)
        search = kernel.mode_search
        print(json.dumps({"attempts": search.attempts, "is_mode": bool(search.is_mode),
                          "dtype": str(mcmc.get_samples()["w"].dtype)}))
    """)
    assert result == {"attempts": 1, "is_mode": True, "dtype": "float32"}


def test_too_few_effective_draws_warn():
    """A run whose draws are too few to summarise (20 draws, about 9 effective) says so at
    conversion, naming the site and the remedy; 1000 draws of the same chain (hundreds
    effective) do not warn."""
    import warnings

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=4):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    X = jax.random.normal(jax.random.PRNGKey(0), (400, 3))
    y = (X[:, 0] > 0) * 1.0
    short = MCMC(nf.FedZigZag(model, sample_interval=0.5), num_warmup=100, num_samples=20, progress_bar=False)
    short.run(jax.random.PRNGKey(2), X, y)
    with pytest.warns(RuntimeWarning, match=r"'w' \(element \d of 3\) has [\d.]+ effective draws.*num_samples"):
        nf.to_inference_data(short)
    long = MCMC(nf.FedZigZag(model, sample_interval=0.5), num_warmup=100, num_samples=1000, progress_bar=False)
    long.run(jax.random.PRNGKey(2), X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nf.to_inference_data(long)


def test_mode_search_finishes_with_newton_where_the_value_is_too_coarse_for_bfgs():
    """With a million rows in float32 the potential's value no longer resolves the last
    posterior sds near the mode (BFGS's line search stalls at the start), while its gradient
    and Hessian do: Newton's steps take the search to the mode. Here the value is rounded to
    1e6 (posterior sds 1e-3 to 2e-3: the whole basin within a few sds looks flat) and the
    gradient is exact."""
    from numpyro_fed.infer.zigzag.mode import find_mode

    hessian = np.diag([1e6, 4e5, 2e5]).astype(np.float32)
    mode = np.array([0.3, -0.2, 0.1], np.float32)

    @jax.custom_jvp
    def coarse(x):
        d = x - mode
        return jnp.round(0.5 * d @ hessian @ d / 1e6) * 1e6

    @coarse.defjvp
    def coarse_jvp(primals, tangents):
        (x,), (u,) = primals, tangents
        return coarse(x), (hessian @ (x - mode)) @ u

    # float32 as users run it (the tests enable float64 globally)
    jax.config.update("jax_enable_x64", False)
    try:
        search = find_mode(coarse, jnp.zeros(3, jnp.float32))
    finally:
        jax.config.update("jax_enable_x64", True)
    assert search.is_mode and search.newton_step <= 0.05
    # within 0.05 posterior sds of the mode in every coordinate
    np.testing.assert_array_less(
        np.abs(np.asarray(search.point) - np.asarray(mode)), 0.05 / np.sqrt(np.diag(np.asarray(hessian)))
    )


def test_float32_mode_search_reaches_the_mode_of_a_regression_on_raw_covariates_from_far_out():
    """log earnings on height in inches (near 66, raw) with ``sigma ~ HalfCauchy``, started
    where ``init_to_uniform`` puts it (coefficients in [-2, 2], log sigma near -1.7: a
    potential of 1e8 and gradients of 1e9). In float32 BFGS's line search fails at once there
    and the search used to stop with no mode: the default preconditioner was then off and the
    chain crawled through the (alpha, beta) ridge. Levenberg-Marquardt's damped Newton steps
    reach the mode; it must agree with float64's within 0.05 Laplace sds."""
    from numpyro_fed.infer.zigzag.mode import find_mode

    rng = np.random.default_rng(1)
    height = rng.normal(66.0, 3.8, size=1200)
    male = (rng.random(1200) < 0.4) * 1.0
    log_earnings = 5.8 + 0.06 * height + 0.42 * male + rng.normal(0.0, 0.9, size=1200)

    def model(height, male, y):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 10.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
        sigma = numpyro.sample("sigma", dist.HalfCauchy(5.0))
        with nf.federated_plate("data", y.shape[0], clients=4):
            numpyro.sample("y", dist.Normal(alpha + beta[0] * height + beta[1] * male, sigma), obs=y)

    start = np.array([-1.97, -1.58, -0.62, -1.67])  # (alpha, beta, log sigma) from init_to_uniform
    found = {}
    for dtype in (np.float32, np.float64):
        jax.config.update("jax_enable_x64", dtype == np.float64)
        try:
            args = tuple(a.astype(dtype) for a in (height, male, log_earnings))
            flat = nf.split_potential(model, args).flat()
            x0 = jnp.asarray(start, dtype)
            assert float(flat.potential(x0)) > 1e7  # far out
            found[dtype] = find_mode(flat.potential, x0)
        finally:
            jax.config.update("jax_enable_x64", True)
    assert found[np.float32].is_mode and found[np.float64].is_mode
    hessian = jax.hessian(flat.potential)(found[np.float64].point)
    sd = np.sqrt(np.diag(np.linalg.inv(np.asarray(hessian))))
    np.testing.assert_array_less(
        np.abs(np.asarray(found[np.float32].point, np.float64) - np.asarray(found[np.float64].point)), 0.05 * sd
    )


def test_mode_search_of_a_log_linear_model_reaches_the_mode_where_its_rates_overflow_or_underflow():
    """Counts against a raw dose near 1000: a slope of 0.05 puts the rates at ``exp(50)`` (each
    Newton step lowers every linear predictor by about one and the step in sds does not
    shrink: the search used to end without a mode, and the chain stalled), one of -0.59 at
    ``exp(-590)``, whose squares underflow in the Hessian's autodiff (a NaN Hessian, a finite
    gradient: the search used to stay at its start). From each start the search must end
    within 0.05 Laplace sds of the mode scipy finds from a start near it."""
    from scipy.optimize import minimize

    from numpyro_fed.infer.zigzag.mode import find_mode

    rng = np.random.default_rng(0)
    dose = rng.normal(1000.0, 50.0, 120)
    counts = rng.poisson(np.exp(0.5 + 0.001 * dose)) * 1.0

    def model(dose, counts):
        a = numpyro.sample("a", dist.Normal(0.0, 5.0))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with nf.federated_plate("data", dose.shape[0], clients=4):
            numpyro.sample("counts", dist.Poisson(jnp.exp(a + b * dose)), obs=counts)

    flat = nf.split_potential(model, (dose, counts)).flat()
    value_and_grad = jax.jit(jax.value_and_grad(flat.potential))
    hessian = jax.jit(jax.hessian(flat.potential))
    reference = minimize(
        lambda x: tuple(np.asarray(v, np.float64) for v in value_and_grad(jnp.asarray(x))),
        np.array([1.0, 0.0]),
        jac=True,
        hess=lambda x: np.asarray(hessian(jnp.asarray(x)), np.float64),
        method="trust-exact",
        options={"gtol": 1e-6},
    )
    reference = reference.x  # "a bad approximation" stops it at float64's resolution: checked below
    inverse = np.linalg.inv(np.asarray(hessian(jnp.asarray(reference))))
    sd = np.sqrt(np.diag(inverse))
    newton = inverse @ np.asarray(value_and_grad(jnp.asarray(reference))[1])
    np.testing.assert_array_less(np.abs(newton), 1e-3 * sd)  # scipy's point is the mode
    assert not np.all(np.isfinite(np.asarray(hessian(jnp.array([0.68, -0.59])))))
    for start in ([0.68, -0.59], [0.0, 0.3], [0.0, 0.05], [0.0, -0.05], [1.0, 0.0]):
        search = find_mode(flat.potential, jnp.array(start))
        assert search.is_mode, start
        np.testing.assert_array_less(np.abs(np.asarray(search.point) - reference), 0.05 * sd)


def test_an_estimate_below_one_effective_draw_is_not_printed():
    """NumPyro's estimator goes negative on a few draws of chains that disagree (-79 here):
    the message says "less than one", not a negative count."""
    from numpyro_fed.infer.zigzag.diagnostics import few_effective_draws

    draws = np.array([[-0.518, -0.534, 0.451, -0.033, -1.31, 1.011], [0.726, -0.62, 0.111, 0.206, 0.035, -0.225]])
    assert float(effective_sample_size(draws)) < 0
    (message,) = few_effective_draws({"mu": draws}, 50)
    assert message.startswith("'mu' has less than one effective draw (fewer than 50)")
