"""D-ADMMS on a posterior without a mode: a centred hierarchy, whose joint density grows
without bound as the group scale goes to 0 (the funnel). ``rho="auto"``'s mode search runs
down the funnel; the run says so at set-up, naming the coordinate and what the search
measured, and scales the agents at a point of the bulk with the network's average at
temperature one (at the paper's ``rho = 5`` the iterates ran down the funnel and stopped being
finite). Checked against NUTS on the same model written non-centred."""

import re
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.handlers import reparam
from numpyro.infer import MCMC, NUTS
from numpyro.infer.reparam import LocScaleReparam

import numpyro_fed as nf
from numpyro_fed.infer.admm.agents import agent_potentials
from numpyro_fed.infer.admm.scaling import laplace_scaling, tempered_settings

GROUPS, PER_GROUP = 8, 3
_rng = np.random.default_rng(0)
GROUP = np.repeat(np.arange(GROUPS), PER_GROUP)
Y = 1.0 + 0.5 * _rng.normal(size=GROUPS)[GROUP] + _rng.normal(size=GROUP.size)


def centred(group, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    with nf.federated_plate("groups", GROUPS, clients=np.arange(GROUPS) // 2):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
    with nf.federated_plate("data", y.shape[0], clients=GROUP // 2):
        numpyro.sample("y", dist.Normal(theta[group], 1.0), obs=y)


def test_mode_search_reports_where_it_ran_away():
    potential = nf.split_potential(centred, model_args=(GROUP, Y))
    potentials = agent_potentials(potential, None)
    x0 = potential.ravel(potential.init_params)
    search = {}
    assert laplace_scaling(potentials, x0, report=search) is None
    j = potential.coordinate_names.index("tau")
    assert not search["converged"]
    assert search["value_end"] < search["value_start"]
    # the search ran down log tau (the funnel), farther than any other coordinate
    assert search["end"][j] < search["start"][j] - 5.0
    assert int(np.argmax(np.abs(search["end"] - search["start"]))) == j


@pytest.mark.long  # 15-21 s on 2 cores
def test_dadmms_names_the_funnel_at_set_up():
    kernel = nf.DADMMS(centred)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=2, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(jax.random.PRNGKey(0), GROUP, jnp.asarray(Y))
    messages = [str(w.message) for w in caught if "found no mode" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    found = re.search(r"moving tau \(unconstrained\) from (\S+) to (\S+):", messages[0])
    assert found, messages[0]
    assert float(found.group(2)) < float(found.group(1)) - 5.0
    assert "temperature one" in messages[0]
    # scaled at a surrogate point (not a mode) with the network's average at temperature one
    assert kernel.scaling is not None and not kernel.scaling.mode
    adjacency = np.asarray(kernel.graph.adjacency)
    assert (kernel.rho_used, kernel.noise_scale_used) == tempered_settings(adjacency, kernel.scaling.shares)
    degrees = adjacency.sum(1)
    temperature = kernel.noise_scale_used**2 * (degrees**2).sum() / (2 * kernel.rho_used * degrees.sum())
    assert temperature == pytest.approx(1.0)


@pytest.mark.long  # 15-21 s on 2 cores
def test_paper_rho_runs_down_the_funnel_and_the_run_says_where():
    """The fixed ``rho = 5``: the network's average runs at temperature 0.2, below the funnel's
    ``(J - 1) / J``, and the iterates run down ``log tau`` (the end-of-run check says so)."""
    mcmc = MCMC(
        nf.DADMMS(centred, rho=5.0),
        num_warmup=0,
        num_samples=150,
        num_chains=4,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(0), GROUP, jnp.asarray(Y))
    log_tau = np.log(np.asarray(nf.DADMMS.agent_draws(mcmc, 0, group_by_chain=True)["tau"]))
    with np.errstate(invalid="ignore"):
        assert np.all((log_tau[:, -1] < -8) | ~np.isfinite(log_tau[:, -1]))


@pytest.mark.long
def test_default_draws_on_a_centred_funnel_are_finite_and_checked_against_nuts():
    """Finite draws where ``rho = 5`` runs down the funnel. This posterior (3 rows per group)
    reaches into the funnel's neck, and the draws are too wide there (measured: ``log tau`` 2.2
    times NUTS's sd, the group effects 1.3-1.6, ``mu`` within 1.4): the end-of-run check must
    say so."""
    kernel = nf.DADMMS(centred)
    mcmc = MCMC(kernel, num_warmup=500, num_samples=100, num_chains=20, chain_method="vectorized", progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(jax.random.PRNGKey(1), GROUP, jnp.asarray(Y))
    draws = nf.DADMMS.agent_draws(mcmc, 0)
    noncentred = reparam(centred, config={"theta": LocScaleReparam(0)})
    nuts = MCMC(NUTS(noncentred), num_warmup=1000, num_samples=4000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(2), GROUP, jnp.asarray(Y))
    ref = nuts.get_samples()
    ratios = {}
    for name, f in (("mu", lambda v: v), ("tau", np.log), ("theta", lambda v: v)):
        x, r = np.asarray(f(draws[name])), np.asarray(f(ref[name]))
        assert np.all(np.isfinite(x)), name
        ratios[name] = x.std(0) / r.std(0)
    outside = [name for name, ratio in ratios.items() if not np.all((ratio > 1 / 1.4) & (ratio < 1.4))]
    if outside:
        problems = kernel.diagnose(mcmc).problems
        assert problems and "do not match the posterior" in problems[0], problems
