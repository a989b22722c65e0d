"""D-ADMMS on a posterior without a mode: a centred hierarchy, whose joint density grows
without bound as the group scale goes to 0 (the funnel). ``rho="auto"``'s mode search runs
down the funnel; the run must say so at set-up, naming the coordinate and what the search
measured, not only after the iterates have stopped being finite."""

import re
import warnings

import numpy as np

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.infer.admm.agents import agent_potentials
from numpyro_fed.infer.admm.scaling import laplace_scaling

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


def test_dadmms_names_the_funnel_at_set_up():
    mcmc = MCMC(nf.DADMMS(centred), num_warmup=0, num_samples=2, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(jax.random.PRNGKey(0), GROUP, jnp.asarray(Y))
    messages = [str(w.message) for w in caught if "found no mode" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    found = re.search(r"moving tau \(unconstrained\) from (\S+) to (\S+):", messages[0])
    assert found, messages[0]
    assert float(found.group(2)) < float(found.group(1)) - 5.0
    assert "FedZigZag" in messages[0] and "LocScaleReparam" in messages[0]
    # the end-of-run check's advice for diverged iterates names the same cause
    assert "moving tau (unconstrained)" in mcmc.sampler.divergence_advice


def test_a_model_with_a_mode_keeps_the_generic_advice():
    def pooled(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with nf.federated_plate("data", y.shape[0], clients=4):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    kernel = nf.DADMMS(pooled)
    MCMC(kernel, num_warmup=0, num_samples=2, progress_bar=False).run(jax.random.PRNGKey(0), jnp.asarray(Y))
    assert kernel.scaling is not None
    assert kernel.divergence_advice == nf.DADMMS.divergence_advice
