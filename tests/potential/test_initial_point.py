"""The initial point: where the init strategy's first draw gives a non-finite potential,
``split_potential`` draws again (up to 100 points, as NumPyro's MCMC does) instead of refusing
the model, and a first draw where NumPyro's validation raises (an invalid parameter) the same
way; where every draw is non-finite it refuses, saying how many it tried."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, init_to_uniform, init_to_value

import numpyro_fed as nf
from numpyro_fed.potential.trace import MAX_INIT_TRIES, discovery_trace

# Counts against a raw covariate near 1000 (a dose in mg, say): NumPyro's init_to_uniform
# draws the slope in (-2, 2), and every slope beyond about 0.7 in size overflows exp (or
# underflows it to a rate of 0 for a count above 0): most first draws are not finite.
RNG = np.random.default_rng(0)
DOSE = jnp.asarray(RNG.normal(1000.0, 50.0, 120))
COUNTS = jnp.asarray(RNG.poisson(np.exp(0.5 + 0.001 * np.asarray(DOSE))), dtype=jnp.float64)


def poisson_dose(dose, counts):
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with nf.federated_plate("data", dose.shape[0], clients=4):
        numpyro.sample("counts", dist.Poisson(jnp.exp(a + b * dose)), obs=counts)


def _first_draw_is_not_finite(key):
    tr = discovery_trace(poisson_dose, (DOSE, COUNTS), {}, key, init_to_uniform)
    return not np.isfinite(float(tr["counts"]["fn"].log_prob(COUNTS).sum()))


def _a_key_whose_first_draw_is_not_finite():
    for seed in range(20):
        if _first_draw_is_not_finite(jax.random.PRNGKey(seed)):
            return jax.random.PRNGKey(seed)
    raise AssertionError("no key among 20 gives a non-finite first draw")


def test_a_non_finite_first_draw_is_drawn_again():
    key = _a_key_whose_first_draw_is_not_finite()
    first = discovery_trace(poisson_dose, (DOSE, COUNTS), {}, key, init_to_uniform)
    fp = nf.split_potential(poisson_dose, (DOSE, COUNTS), rng_key=key)
    z = fp.init_params
    assert float(z["b"]) != float(first["b"]["value"])  # another draw than the first
    assert abs(float(z["b"])) < 2.0  # from the same strategy: NumPyro's uniform (-2, 2)
    total = float(fp.prior_potential(z) + fp.client_potentials(z).sum())
    assert np.isfinite(total)
    assert np.all(np.isfinite(np.asarray(fp.client_potentials(z))))


def test_a_finite_first_draw_is_kept():
    for seed in range(20):
        key = jax.random.PRNGKey(seed)
        if not _first_draw_is_not_finite(key):
            break
    first = discovery_trace(poisson_dose, (DOSE, COUNTS), {}, key, init_to_uniform)
    fp = nf.split_potential(poisson_dose, (DOSE, COUNTS), rng_key=key)
    assert float(fp.init_params["b"]) == float(first["b"]["value"])


def test_no_finite_draw_is_refused_with_the_number_tried():
    bad = init_to_value(values={"a": 0.0, "b": 1.5})  # the same non-finite point at every try
    with pytest.raises(ValueError, match=rf"not finite at any of {MAX_INIT_TRIES} initial points.*init_to_median"):
        nf.split_potential(poisson_dose, (DOSE, COUNTS), init_strategy=bad)


def test_the_algorithms_agree_with_nuts_at_defaults_where_the_first_draw_is_not_finite():
    """FedZigZag, DSVGD and DPPVI at their defaults, on a key whose first draw is not finite
    (each refused the model before): within 0.3 posterior sd of NUTS on the pooled data, sds within
    20 % (NUTS's own Monte Carlo error on 1000 draws is about 0.05 sd, 3 % of an sd)."""
    key = _a_key_whose_first_draw_is_not_finite()
    nuts = MCMC(NUTS(poisson_dose), num_warmup=500, num_samples=1000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(1), DOSE, COUNTS)
    reference = nuts.get_samples()

    zigzag = MCMC(nf.FedZigZag(poisson_dose), num_warmup=500, num_samples=1000, progress_bar=False)
    zigzag.run(key, DOSE, COUNTS)
    dppvi = nf.DPPVI(poisson_dose)
    dppvi_draws = dppvi.get_samples(key, dppvi.run(key, 10, DOSE, COUNTS), 2000)
    dsvgd = nf.DSVGD(poisson_dose)
    dsvgd_draws = dsvgd.get_samples(key, dsvgd.run(key, 10, DOSE, COUNTS), 2000)
    for draws in (zigzag.get_samples(), dppvi_draws, dsvgd_draws):
        for site in ("a", "b"):
            sd = float(jnp.std(reference[site]))
            assert abs(float(jnp.mean(draws[site]) - jnp.mean(reference[site]))) < 0.3 * sd
            assert 1 / 1.2 < float(jnp.std(draws[site])) / sd < 1.2


# Blood pressure whose noise grows with age in years (raw): the scale exp(c + d * age) of a
# first draw d in (-2, 2) overflows (or underflows to 0) at ages near 800 in float64 as near
# 80 in float32, and NumPyro's validation raises "Normal distribution got invalid scale
# parameter" while the model is traced, before any potential is evaluated.
AGE = jnp.asarray(RNG.uniform(500.0, 800.0, 80))
PRESSURE = jnp.asarray(RNG.normal(120.0, 5.0, 80))


def noise_grows_with_age(age, y):
    a = numpyro.sample("a", dist.Normal(100.0, 50.0))
    d = numpyro.sample("d", dist.Normal(0.0, 1.0))
    with nf.federated_plate("people", age.shape[0], clients=4):
        numpyro.sample("y", dist.Normal(a, jnp.exp(1.0 + d * age)), obs=y)


def _raises_invalid_scale(key):
    try:
        discovery_trace(noise_grows_with_age, (AGE, PRESSURE), {}, key, init_to_uniform)
    except ValueError as exc:
        assert "invalid scale parameter" in str(exc)
        return True
    return False


def test_a_first_draw_with_an_invalid_parameter_is_drawn_again():
    key = next((k for k in map(jax.random.PRNGKey, range(20)) if _raises_invalid_scale(k)), None)
    assert key is not None, "no key among 20 gives a first draw with an invalid scale"
    fp = nf.split_potential(noise_grows_with_age, (AGE, PRESSURE), rng_key=key)
    z = fp.init_params
    assert abs(float(z["d"])) < 709.0 / 500.0  # a draw where exp(1 + d * age) is finite
    assert np.isfinite(float(fp.prior_potential(z) + fp.client_potentials(z).sum()))


def test_data_that_make_a_parameter_invalid_everywhere_are_refused_with_the_number_tried():
    def measured_sd(y, sd):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with nf.federated_plate("rows", y.shape[0], clients=2):
            numpyro.sample("y", dist.Normal(mu, sd), obs=y)

    y, sd = jnp.zeros(6), jnp.array([1.0, 1.0, -1.0, 1.0, 1.0, 1.0])  # a negative sd in the data
    with pytest.raises(ValueError, match=rf"invalid scale parameter.*every one of {MAX_INIT_TRIES} initial points"):
        nf.split_potential(measured_sd, (y, sd))
