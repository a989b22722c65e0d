"""DSVGD's Gaussian carrier of a client's factor and the damped cavity, against closed forms."""

import numpy as np
import pytest
from scipy import stats

import jax.numpy as jnp
import optax

from numpyro_fed.infer.stein import cavity
from numpyro_fed.infer.stein import dsvgd as core
from numpyro_fed.infer.stein.kde import AUTO_KDE_FACTOR


def _gaussian_particles(n, cov, dtype):
    """``n`` quantile-spaced points along each axis mapped to ``N(0, cov)`` (exact moments up to
    the quantiles' own)."""
    d = cov.shape[0]
    q = stats.norm.ppf((np.arange(n) + 0.5) / n)
    rng = np.random.default_rng(0)
    z = np.stack([rng.permutation(q) for _ in range(d)], 1)
    z = (z - z.mean(0)) @ np.linalg.inv(np.linalg.cholesky(np.atleast_2d(np.cov(z.T, bias=True)))).T  # exactly whitened
    return jnp.asarray(z @ np.linalg.cholesky(cov).T, dtype)


def test_gaussian_score_is_the_closed_form(precision):
    dtype = jnp.float64 if precision == "float64" else jnp.float32
    cov = np.array([[4.0, 1.2], [1.2, 1.0]])
    mean = np.array([1.0, -2.0])
    x = jnp.asarray([[0.5, 0.0], [3.0, -1.0]], dtype)
    score = cavity.gaussian_score(jnp.asarray(mean, dtype), jnp.asarray(np.linalg.cholesky(cov), dtype))(x)
    expected = -(np.asarray(x, np.float64) - mean) @ np.linalg.inv(cov)
    np.testing.assert_allclose(np.asarray(score), expected, rtol=1e-5)


@pytest.mark.parametrize("previous_sd, expected", [(1.0, 0.25), (2.0, 0.0), (0.5, 0.25 + 3 / 0.85**2)])
def test_carrier_weight_is_the_least_that_keeps_the_factor_proper(precision, previous_sd, expected):
    """1-D, flat prior, a first visit: q^(i) = N(0, 1), q^(i-1) of sd ``previous_sd``; far out
    the new factor's precision is ``(1 - 1/s^2) / f^2``: with ``s = 2`` (the client's rows
    halved the variance) it is proper with room to spare (weight 0); with ``s = 1`` (they said
    nothing) it is flat and the carrier gives it the margin; with ``s = 0.5`` (noise: q^(i) wider
    than q^(i-1)) it is improper and the carrier makes up the difference."""
    dtype = jnp.float64 if precision == "float64" else jnp.float32
    new_global = _gaussian_particles(20, np.eye(1), dtype)
    previous = jnp.asarray([[1.0 / previous_sd**2]], dtype)
    weight = cavity.carrier_weight(new_global, previous, jnp.zeros((1, 1), dtype), lambda x: jnp.zeros_like(x))
    assert float(weight) == pytest.approx(expected, rel=1e-3, abs=2e-3)  # float32: the ridge of sqrt(eps)


def test_carrier_score_is_the_prior_times_a_power_of_a_gaussian(precision):
    dtype = jnp.float64 if precision == "float64" else jnp.float32
    mean, chol = jnp.asarray([1.0], dtype), jnp.asarray([[2.0]], dtype)
    score = cavity.carrier_score_of((mean, chol, jnp.asarray(0.5, dtype)), lambda x: -x / 100.0)
    x = jnp.asarray([[3.0]], dtype)
    assert float(score(x)[0, 0]) == pytest.approx(-0.03 - 0.5 * 2.0 / 4.0, rel=1e-5)


@pytest.mark.parametrize("local_sd, expect_damped", [(1.0, False), (0.55, True)])
def test_cavity_power_damps_only_an_improper_tilted_target(precision, local_sd, expect_damped):
    """1-D, all Gaussian: q = N(0, 1), a carrier N(0, 1) and a likelihood of precision h.
    Far from the particles the tilted target's precision is ``1/f^2 + h + gamma (1 - 1/(f^2
    s^2))`` for local particles of sd ``s``; with ``s = 1`` (the factor is flat) nothing is
    damped, with ``s = 0.55`` the undamped target is improper and gamma gives it exactly the
    margin."""
    dtype = jnp.float64 if precision == "float64" else jnp.float32
    h = 0.25
    global_particles = _gaussian_particles(20, np.eye(1), dtype)
    local_particles = local_sd * global_particles

    def carrier_score(x):
        return -x

    def client_grad(x):  # grad L_k, L_k = h x^2 / 2
        return h * x

    gamma = float(cavity.cavity_power(global_particles, local_particles, carrier_score, client_grad, 1.0))
    tail = 1.0 / AUTO_KDE_FACTOR**2
    a, b = tail + h, 1.0 - tail / local_sd**2
    if not expect_damped:
        assert gamma == 1.0
        return
    assert a + b < 0  # the undamped tilted target is improper in its tails
    assert gamma == pytest.approx((1.0 - cavity.CAVITY_MARGIN) * a / -b, rel=1e-3)
    assert a + gamma * b == pytest.approx(cavity.CAVITY_MARGIN * a, rel=1e-3)


def test_cavity_power_is_invariant_to_units(precision):
    """Affine invariance: the same configuration in units 1000 times smaller (shifted) gives the
    same gamma."""
    dtype = jnp.float64 if precision == "float64" else jnp.float32
    cov = np.array([[1.0, 0.6], [0.6, 1.0]])
    g = _gaussian_particles(20, cov, dtype)
    loc = 0.5 * _gaussian_particles(20, cov, dtype)
    inv = jnp.asarray(np.linalg.inv(cov), dtype)
    gamma = cavity.cavity_power(g, loc, lambda x: -x @ inv, lambda x: 0.2 * x @ inv, 1.0)
    scale, shift = jnp.asarray([1e-3, 1e-3], dtype), jnp.asarray([5.0, -5.0], dtype)
    inv_s = inv / (scale[:, None] * scale[None, :])
    gamma_s = cavity.cavity_power(
        g * scale + shift,
        loc * scale + shift,
        lambda x: -(x - shift) @ inv_s,
        lambda x: 0.2 * (x - shift) @ inv_s,
        1.0,
    )
    assert 0.0 < float(gamma) < 1.0
    assert float(gamma_s) == pytest.approx(float(gamma), rel=1e-3)


def test_a_first_visit_is_never_damped():
    """A client not yet visited has t_k = 1 exactly: its round's cavity is q itself."""
    x = _gaussian_particles(20, np.eye(1), jnp.float64)
    update = core.update_particles(
        x,
        0.1 * x,  # local particles that would be damped, were they used
        None,
        prior_score=lambda x: -x,
        client_grad=lambda x, block, key=None: x,
        kde_score=lambda x, centers: -(x - centers.mean(0)) / centers.var(0),
        temperature=1.0,
        num_local_steps=1,
        num_distill_steps=1,
        optim=optax.sgd(0.0),
        distill_optim=optax.sgd(0.0),
        svgd_bandwidth=1.0,
        visited=False,
        carrier_score=lambda x: -x,
    )
    np.testing.assert_allclose(np.asarray(update.global_particles), np.asarray(x))
