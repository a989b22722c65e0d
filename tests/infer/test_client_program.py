"""The client program is an artefact of every variational face: ``method.client_program(rng_key,
num_rounds, *data)`` is the program ``method.run(rng_key, num_rounds, *data)`` starts its
clients on (what an engine starts on its workers and a Flower node builds), built without
starting a client."""

import numpy as np
import pytest

import jax

import numpyro_fed as nf

from models import logistic_regression, make_data

CASES = {
    "dppvi": lambda: nf.DPPVI(logistic_regression, progress_bar=False),
    "dppvi-dpsgd": lambda: nf.DPPVI(
        logistic_regression, dp="dpsgd", noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.5, progress_bar=False
    ),
    "gaussian_pvi": lambda: nf.GaussianPVI(logistic_regression, num_local_steps=5, progress_bar=False),
    "dsvgd": lambda: nf.DSVGD(
        logistic_regression, num_particles=4, num_local_steps=3, num_distill_steps=3, progress_bar=False
    ),
    "udsvgd": lambda: nf.UDSVGD(logistic_regression, num_particles=4, num_local_steps=3, progress_bar=False),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # two rounds: the fits' convergence is not the point
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_client_program_is_the_one_a_run_starts(case):
    data, key = make_data("logistic_regression"), jax.random.PRNGKey(3)
    program = CASES[case]().client_program(key, 2, *data)
    method = CASES[case]()
    method.run(key, 2, *data)
    started = method._active_federation.program
    assert set(program.functions) == set(started.functions) and set(program.stateful) == set(started.stateful)
    assert program.loader is None and len(program.blocks) == len(started.blocks) == 4
    for mine, theirs in zip(program.blocks, started.blocks):  # each client's block, its layout included
        assert jax.tree.structure(mine) == jax.tree.structure(theirs)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            np.testing.assert_array_equal(a, b)


def test_in_deployment_the_program_loads_its_rows_where_the_client_lives():
    X, y = (np.asarray(a) for a in make_data("logistic_regression"))
    bounds = np.linspace(0, len(y), 5).astype(int)

    def load(m):
        return X[bounds[m] : bounds[m + 1]], y[bounds[m] : bounds[m + 1]]

    method = nf.DPPVI(logistic_regression, federation=nf.InProcess(loader=load, num_clients=4), progress_bar=False)
    program = method.client_program(jax.random.PRNGKey(0), 2)  # no data: the clients hold it
    assert program.blocks is None and program.num_clients == 4 and callable(program.loader)
    assert not method.federation.started  # built, not started
