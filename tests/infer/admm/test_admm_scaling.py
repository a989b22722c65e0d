"""D-ADMMS's default ``rho="auto"``: the spread of the draws is the posterior's, in any units.

A linear regression with flat priors on raw covariates of scales 1 and 100 and a known noise
sd: the posterior is Gaussian in closed form, ``N((X'X)^-1 X'y, (X'X)^-1)``, with coefficient
sds three orders of magnitude apart. At the paper's fixed ``rho = 5`` D-ADMMS's noise has the
same sd in every coordinate whatever the posterior's width, and the sds of the draws are far
from the posterior's (checked below, so that the test can fail).
"""

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.infer import MCMC

import numpyro_fed as nf

CLIENTS, ROWS = 4, 200
_rng = np.random.default_rng(3)
RAW = np.column_stack([_rng.normal(size=ROWS), 100.0 + 100.0 * _rng.normal(size=ROWS)])  # scales 1 and 100
Y = 2.0 + RAW @ np.array([0.5, -0.01]) + _rng.normal(size=ROWS)


def regression(X, y):
    alpha = numpyro.sample("alpha", dist.ImproperUniform(constraints.real, (), ()))
    beta = numpyro.sample("beta", dist.ImproperUniform(constraints.real, (), (X.shape[1],)))
    with nf.federated_plate("data", X.shape[0], clients=CLIENTS):
        numpyro.sample("y", dist.Normal(alpha + X @ beta, 1.0), obs=y)


def _exact(X):
    design = np.column_stack([np.ones(ROWS), X])
    cov = np.linalg.inv(design.T @ design)
    return cov @ design.T @ Y, np.sqrt(np.diag(cov))


def _run(X, dtype, **kwargs):
    mcmc = MCMC(
        nf.DADMMS(regression, **kwargs),
        num_warmup=100,
        num_samples=200,
        num_chains=20,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(0), jnp.asarray(X, dtype), jnp.asarray(Y, dtype))
    samples = mcmc.get_samples()
    draws = np.column_stack([np.asarray(samples["alpha"], np.float64), np.asarray(samples["beta"], np.float64)])
    return mcmc, draws


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    if request.param == "float64":
        with jax.enable_x64(True):
            yield jnp.float64
    else:
        yield jnp.float32


def test_default_spread_matches_the_posterior_on_raw_covariates(dtype):
    """Sds within a factor 1.25 of the exact posterior's and means within 0.3 of its sds.
    Tolerances: 20 chains x 200 draws (after 100 of warm-up from draws of the Laplace
    approximation) with an autocorrelation time near 9 iterations (the
    calibration's), an ESS near 450, so the sd's relative Monte Carlo error is about 3.5 % and
    the mean's about 0.05 sd: both bounds are beyond 5 standard errors. The run's own check is
    silent."""
    import warnings

    mean, sd = _exact(RAW)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        mcmc, draws = _run(RAW, dtype)
    ratio = draws.std(0) / sd
    assert np.all((ratio > 1 / 1.25) & (ratio < 1.25)), ratio
    assert np.all(np.abs(draws.mean(0) - mean) < 0.3 * sd), (draws.mean(0) - mean) / sd
    kernel = mcmc.sampler
    assert kernel.rho_used is not None and kernel.scaling is not None
    # the set-up's rounds are in the ledger: per round each agent got the point and sent back
    # its value, gradient and Hessian (1 + 3 + 9 floats)
    ledger = kernel.message_ledger(mcmc)
    rounds, itemsize = kernel.scaling.rounds, np.asarray(mcmc.get_samples()["alpha"]).dtype.itemsize
    np.testing.assert_array_equal(ledger["DADMMS/laplace/messages_from_client"], rounds)
    np.testing.assert_array_equal(ledger["DADMMS/laplace/bytes_from_client"], rounds * 13 * itemsize)
    # the paper's fixed rho in the model's units: the scale-100 coefficient (posterior sd about
    # 5e-4) gets the same noise as the others, and the run says so
    with pytest.warns(RuntimeWarning, match=r"sd ratio about"):
        _, fixed = _run(RAW, dtype, rho=5.0)
    fixed_ratio = fixed.std(0) / sd
    assert np.any((fixed_ratio < 1 / 1.4) | (fixed_ratio > 1.4)), fixed_ratio


def test_default_draws_do_not_depend_on_the_units_of_the_covariates(dtype):
    """The same data with the second covariate in units 100 times larger (and the first in
    units 10 times smaller): the coefficients' draws are the first run's rescaled, draw by
    draw (the set-up's Cholesky factor rescales exactly, so the noise draws are the same), up
    to round-off and the set-up's Newton tolerance."""
    scale = np.array([0.1, 100.0])
    _, draws = _run(RAW, dtype)
    _, rescaled = _run(RAW / scale, dtype)
    _, sd = _exact(RAW)
    tolerance = 1e-6 if dtype == jnp.float64 else 0.05
    in_model_units = np.column_stack([rescaled[:, :1], rescaled[:, 1:] / scale])
    assert np.max(np.abs(in_model_units - draws) / sd) < tolerance


def squared(y):
    """``y ~ Normal(mu^2, 0.5)`` with ``mu ~ Normal(3, 1)``: modes near ``mu = +-2``, 90
    posterior sds apart, the prior putting all but 1e-5 of the mass at ``+2``."""
    mu = numpyro.sample("mu", dist.Normal(3.0, 1.0))
    with nf.federated_plate("data", y.shape[0], clients=4):
        numpyro.sample("y", dist.Normal(mu**2, 0.5), obs=y)


def test_set_up_runs_at_the_mode_with_the_mass():
    """The set-up's mode search runs from the run's start and from the prior's medians, and
    keeps the mode with the larger Laplace mass. Seed 0's start (``init_to_uniform``) is at a
    negative ``mu``: from there alone the set-up scaled and started the agents at ``-2``, and
    the draws sat there (mean -1.995, without a warning: they match the local score)."""
    y = 4.0 + 0.5 * jax.random.normal(jax.random.PRNGKey(3), (8,))
    grid = np.linspace(-4, 4, 400_001)
    log_p = -0.5 * (grid - 3.0) ** 2 - 0.5 * (((np.asarray(y)[:, None] - grid**2) / 0.5) ** 2).sum(0)
    p = np.exp(log_p - log_p.max())
    p /= p.sum()
    mean = (p * grid).sum()
    sd = np.sqrt((p * (grid - mean) ** 2).sum())
    sampler = nf.DADMMS(squared)
    mcmc = MCMC(sampler, num_warmup=300, num_samples=100, num_chains=10, chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), y)
    assert float(sampler.federated_potential.init_params["mu"]) < 0  # the start the case is about
    assert sampler.scaling.mode and sampler.scaling.center[0] == pytest.approx(2.0104, abs=1e-3)
    mu = np.asarray(mcmc.get_samples()["mu"])
    assert abs(mu.mean() - mean) < 0.3 * sd and 1 / 1.4 < mu.std() / sd < 1.4


# Clients that hold different covariates: client 0's rows vary in the second covariate, the
# others' in the first (each client's other covariate at a tenth of the scale), so the agents'
# Hessians are not proportional. A scalar noise calibrated on the average shares gave draws
# whose sds were 1.08, 1.28 and 0.85 of the posterior's (intercept, first and second
# coefficient); shaped, 0.99, 0.99 and 0.98.
_split = np.random.default_rng(0).normal(size=(ROWS, 2))
_split[: ROWS // CLIENTS, 0] *= 0.1
_split[ROWS // CLIENTS :, 1] *= 0.1
SPLIT = _split


def test_noise_is_shaped_where_clients_hold_different_covariates(monkeypatch):
    """Sds within a factor 1.15 of the exact posterior's (about 4 standard errors of an sd from
    20 chains x 200 draws, ESS near 450), means within 0.3 sd; with the shape switched off
    (the scalar calibration alone) the first coefficient's sd is more than 1.2 times the
    posterior's, so the test can fail."""
    from numpyro_fed.infer.admm import auto

    with jax.enable_x64(True):
        mean, sd = _exact(SPLIT)
        mcmc, draws = _run(SPLIT, jnp.float64)
        assert mcmc.sampler.noise_shape_used is not None
        ratio = draws.std(0) / sd
        assert np.all((ratio > 1 / 1.15) & (ratio < 1.15)), ratio
        assert np.all(np.abs(draws.mean(0) - mean) < 0.3 * sd), (draws.mean(0) - mean) / sd
        monkeypatch.setattr(auto, "calibrated_noise", lambda *args, **kwargs: None)
        mcmc, scalar = _run(SPLIT, jnp.float64)
        assert mcmc.sampler.noise_shape_used is None
        assert scalar.std(0)[1] / sd[1] > 1.2, scalar.std(0) / sd


def test_calibrated_noise_matches_the_posterior_in_every_direction():
    """The linear recursion's stationary covariance (the discrete Lyapunov equation) with the
    calibrated noise is the identity in the whitened coordinates, off the diagonal too; with
    proportional Hessians it is the scalar noise of ``auto_settings``."""
    from numpyro_fed.infer.admm.scaling import auto_settings, calibrated_noise, stationary_covariance

    ring = np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], float)
    rng = np.random.default_rng(1)
    factors = [rng.normal(size=(3, 3)) for _ in range(4)]
    hessians = np.stack([f @ f.T + 0.1 * np.eye(3) for f in factors])
    root = np.linalg.cholesky(hessians.sum(0))
    whiten = np.linalg.inv(root)
    hessians = np.einsum("ij,njk,lk->nil", whiten, hessians, whiten)  # they sum to I
    rho = 0.25
    q = calibrated_noise(ring, hessians, rho, 2)
    np.testing.assert_allclose(stationary_covariance(ring, hessians, rho, 2, q), np.eye(3), atol=1e-6)  # its tolerance
    scalar = stationary_covariance(ring, hessians, rho, 2, np.mean(np.diag(q)) * np.eye(3))
    assert np.max(np.abs(scalar - np.eye(3))) > 0.05  # a scalar noise cannot do it here
    shares = np.full(4, 0.25)
    _, noise = auto_settings(ring, shares, 0, mixing=0.8)
    proportional = calibrated_noise(ring, shares[:, None, None] * np.eye(3), rho, 0)
    np.testing.assert_allclose(proportional, noise**2 * np.eye(3), rtol=1e-6)


def test_set_up_search_off_the_support_is_silent():
    """Agents whose potentials are infinite with opposite signs off the support sum to NaN: the
    set-up's search sees a non-finite value and gives up (no scaling), with no NumPy
    ``RuntimeWarning`` reaching the user."""
    import warnings

    from numpyro_fed.infer.admm.agents import AgentPotentials
    from numpyro_fed.infer.admm.scaling import laplace_scaling

    def fn(x, b, w):
        inside = 2.0 * jnp.sum((x - b) ** 2)
        return jnp.where(x[0] < 2.0, inside, jnp.where(b > 0.5, -jnp.inf, jnp.inf))

    pots = AgentPotentials(fn, jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]), 2, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert laplace_scaling(pots, jnp.array([5.0])) is None
        scaling = laplace_scaling(pots, jnp.array([-1.0]))
    assert scaling is not None and abs(float(scaling.center[0]) - 0.5) < 1e-6


def _set_up(model, args):
    """A ``rho="auto"`` kernel after its set-up (one draw)."""
    kernel = nf.DADMMS(model)
    MCMC(kernel, num_warmup=0, num_samples=1, progress_bar=False).run(jax.random.PRNGKey(0), *args)
    return kernel


def test_curvature_drift_tempers_a_posterior_far_from_gaussian():
    """On a Gaussian posterior the whitened Hessian is the identity everywhere (drift 0 to
    round-off) and ``rho="auto"`` keeps its mixing settings; on the non-centred eight schools
    the Hessian at most draws of the mode's Laplace approximation is not even positive
    definite, and the run is tempered: the network's average at temperature one."""
    from numpyro_fed.infer.admm.scaling import MAX_CURVATURE_DRIFT, auto_settings, tempered_settings

    from models import SCHOOL_ARGS, eight_schools

    with jax.enable_x64(True):
        gaussian = _set_up(regression, (jnp.asarray(RAW), jnp.asarray(Y)))
    assert gaussian.curvature_drift < 1e-6
    adjacency = np.asarray(gaussian.graph.adjacency)
    assert gaussian.rho_used == auto_settings(adjacency, gaussian.scaling.shares)[0]
    schools = _set_up(eight_schools(4), tuple(jnp.asarray(a) for a in SCHOOL_ARGS))
    assert schools.scaling.mode and schools.curvature_drift > MAX_CURVATURE_DRIFT
    adjacency = np.asarray(schools.graph.adjacency)
    assert (schools.rho_used, schools.noise_scale_used) == tempered_settings(adjacency, schools.scaling.shares)
    degrees = adjacency.sum(1)
    temperature = schools.noise_scale_used**2 * (degrees**2).sum() / (2 * schools.rho_used * degrees.sum())
    assert temperature == pytest.approx(1.0)
    # the ledger counts the drift's rounds with the mode search's
    assert schools.scaling.rounds > 8


@pytest.mark.long  # about 100 s on 2 cores: two D-ADMMS runs and NUTS
def test_eight_schools_school_effects_keep_their_spread():
    """The non-centred eight schools over 4 clients (the real-model tier's run: 20 chains of
    100 draws after 1000 of warm-up) against NUTS on the pooled data. Run with the mixing
    settings (the linearization's calibration at temperature 0.43) the school effects' sds are
    about half NUTS's (0.53-0.70 measured); tempered, every unconstrained coordinate's sd is
    within a factor 1.4 of NUTS's. The tempered run mixes slowly (min ESS about 20): the sd's
    relative Monte Carlo error is about 16 %, so 1.4 is about two of its standard errors; the
    median over the eight school effects (error about 6 %) must be within 15 % of NUTS's
    and the untempered one below 0.75."""
    from numpyro_fed.infer.admm import auto

    from models import SCHOOL_ARGS, eight_schools

    model = eight_schools(4)
    args = tuple(jnp.asarray(a) for a in SCHOOL_ARGS)

    def unconstrained(samples):
        return np.column_stack([samples["mu"], np.log(samples["tau"]), samples["theta_tilde"]])

    nuts = MCMC(numpyro.infer.NUTS(model), num_warmup=1000, num_samples=4000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(1), *args)
    reference = unconstrained(nuts.get_samples()).std(0)

    def run():
        mcmc = MCMC(
            nf.DADMMS(model),
            num_warmup=1000,
            num_samples=100,
            num_chains=20,
            chain_method="vectorized",
            progress_bar=False,
        )
        with warnings.catch_warnings(record=True):  # Stein's check: means off by up to 0.5 sd
            warnings.simplefilter("always")
            mcmc.run(jax.random.PRNGKey(0), *args)
        return unconstrained(mcmc.get_samples()).std(0) / reference

    ratio = run()
    assert np.all((ratio > 1 / 1.4) & (ratio < 1.4)), ratio
    assert abs(np.median(ratio[2:]) - 1.0) < 0.15, ratio
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto, "MAX_CURVATURE_DRIFT", np.inf)  # the mixing settings
        mixing = run()
    assert np.median(mixing[2:]) < 0.75, mixing
