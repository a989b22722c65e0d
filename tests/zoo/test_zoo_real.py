"""The zoo's real-model tier: published models on real data, every algorithm at its defaults.

Each (model, split, algorithm, dtype) runs in a child process under the harness's time budget
and is classified agrees / warns / refuses / FAILS against a committed NUTS reference with the
tier's targets (:data:`zoo.harness.REAL_TOLERANCES`). The fast subset below runs in ``make
test``: cells that agree today, one refusal by design, and known failures marked
``xfail(strict=True)`` so that a fix flips them. The whole tier is marked slow;
``tools/zoo_table.py --tier real`` writes its table in ``docs/guide/zoo.md``.
"""

import inspect
import json
import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from numpyro.infer.util import potential_energy

import numpyro_fed as nf

from zoo import harness, real_models
from zoo.harness import compare_real

# Small cells, one per algorithm, both kinds of verdict that pass today (agrees: FedZigZag on
# eight schools; warns: DADMMS on kidiq's flat priors and HalfCauchy scale), a refusal (DPPVI:
# a non-Gaussian prior; issue 24 item 1 lifts it, then the cell must agree or warn), a model with
# client-local latents, and DSVGD on flat priors (a bare NotImplementedError before issue 24).
FAST = [
    ("eight_schools-m4", "FedZigZag", "float64"),
    ("kidiq-m4", "DADMMS", "float64"),
    # DADMMS ends 0.49 sd low on mtcars' scale: it failed silently while the check allowed 1 sd
    ("mtcars-m4", "DADMMS", "float64"),
    ("kidiq-m4", "DSVGD", "float64"),
    ("kidiq-m4", "DPPVI", "float64"),
    ("eight_schools-m4", "DSVGD", "float32"),
]
_FAST_CELLS = [tuple(p.values) if hasattr(p, "values") else p for p in FAST]
FULL = [run for run in harness.all_runs("real") if run not in _FAST_CELLS]


def _ids(runs):
    return ["-".join(tuple(run.values) if hasattr(run, "values") else run) for run in runs]


def _check(case, algorithm, dtype):
    outcome = harness.run_case(case, algorithm, dtype)
    print(outcome.report())
    assert outcome.outcome in ("agrees", "warns", "refuses"), outcome.report()
    return outcome


@pytest.mark.parametrize("case, algorithm, dtype", FAST, ids=_ids(FAST))
def test_zoo_real_fast(case, algorithm, dtype):
    _check(case, algorithm, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("case, algorithm, dtype", FULL, ids=_ids(FULL))
def test_zoo_real(case, algorithm, dtype):
    _check(case, algorithm, dtype)


# -- the tier itself ------------------------------------------------------------------------------


def test_real_tier_has_what_the_issues_ask_for():
    models = real_models.MODELS
    assert len(models) >= (12 if real_models.shared_data_dir() else 9)
    assert any(m.local_sites for m in models.values())
    assert {c.num_clients for c in real_models.REAL_CASES.values()} == set(real_models.SPLITS) == {4, 8}
    # priors as a statistician writes them
    sources = " ".join(inspect.getsource(m.build(1)[0]) for m in models.values())
    assert "HalfCauchy" in sources and "ImproperUniform" in sources and "offset" in sources


@pytest.mark.parametrize("name", sorted(real_models.MODELS))
def test_references_are_converged_and_fresh(name):
    """Every model has a committed NUTS reference: 4 chains, split R-hat < 1.01, ESS >= 1000,
    no divergences, computed on the model and data as they are now."""
    with open(real_models.MODELS[name].reference_path()) as f:
        record = json.load(f)
    assert record["nuts"]["num_chains"] == 4
    assert record["max_rhat"] < 1.01 and record["min_ess"] >= 1000 and record["divergences"] == 0
    ref = harness.real_reference(name)  # raises if stale
    assert np.all(ref["sd"] > 0) and len(ref["coordinates"]) == ref["mean"].size


# The models with client-local effects in make test; the others with the slow tests.
SPLIT_FAST = ("radon", "eight_schools")


@pytest.mark.parametrize(
    "name", [n if n in SPLIT_FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(real_models.MODELS)]
)
def test_split_model_is_the_pooled_model(name):
    """Over 8 clients, the federated potential equals NumPyro's potential of the pooled model,
    and a hierarchical model's group effects are client-local."""
    spec = real_models.MODELS[name]
    model, args = spec.build(8)
    args = tuple(jnp.asarray(a) for a in args)
    fp = nf.split_potential(model, args)
    assert fp.num_clients == 8
    z = fp.unravel(0.1 * jax.random.normal(jax.random.PRNGKey(0), (fp.num_latent,)))
    expected = potential_energy(spec.build(1)[0], args, {}, z)
    assert float(fp.potential(z)) == pytest.approx(float(expected), rel=1e-4, abs=1e-3)
    for site in spec.local_sites:
        owners = np.asarray(fp.coordinate_owner_tree[site])
        assert owners.min() >= 0 and len(np.unique(owners)) == 8, owners


def test_radon_groups_stay_on_one_client():
    county = real_models._num("radon_mn", "county_idx").astype(int) - 1
    for clients in real_models.SPLITS:
        county_owner, row_owner = real_models._by_group(county, clients)
        assert np.array_equal(row_owner, county_owner[county])
        rows = np.bincount(row_owner, minlength=clients)
        assert rows.min() > 0.5 * len(county) / clients, rows


def _ref(mean, sd):
    mean, sd = np.atleast_1d(mean).astype(float), np.atleast_1d(sd).astype(float)
    return {"mean": mean, "sd": sd}


def _summary(mean, sd, ess):
    mean, sd = np.atleast_1d(mean).astype(float), np.atleast_1d(sd).astype(float)
    return {
        "coordinates": [f"x[{i}]" for i in range(mean.size)],
        "mean": mean,
        "sd": sd,
        "ess_mean": np.full(mean.shape, ess),
    }


def test_real_tolerances_are_the_issues_targets():
    ref = _ref([0.0, 10.0], [1.0, 0.01])
    assert compare_real(_summary([0.24, 10.0024], [1.0, 0.0138], 250), ref, "FedZigZag")[0]
    assert not compare_real(_summary([0.26, 10.0], [1.0, 0.01], 250), ref, "FedZigZag")[0]
    assert not compare_real(_summary([0.0, 10.0], [1.0, 0.01], 150), ref, "FedZigZag")[0]  # ESS < 200
    assert not compare_real(_summary([0.0, 10.0], [1.0, 0.0145], 250), ref, "FedZigZag")[0]  # sd x 1.45
    assert compare_real(_summary([0.29, 10.0], [1.45, 0.01], 2000), ref, "DPPVI")[0]
    assert not compare_real(_summary([0.31, 10.0], [1.0, 0.01], 2000), ref, "DSVGD")[0]
    assert not compare_real(_summary([0.0, 10.0], [1.0, 0.01 / 1.45], 2000), ref, "DADMMS")[0]
    assert compare_real(_summary([0.0, 10.0], [1.0, 0.01 / 1.35], 2000), ref, "DADMMS")[0]
    assert math.isclose(harness.REAL_TOLERANCES["DSVGD"].sd_ratio, 1.5)
