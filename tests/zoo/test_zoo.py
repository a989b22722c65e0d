"""The model zoo (issue 12): every algorithm, default settings, models nobody tuned for.

Each (model, algorithm, dtype) runs in a child process under a time budget (a jitted loop
cannot be interrupted from Python) and is classified agrees / warns / refuses / FAILS by
:mod:`zoo.harness`; a test fails on FAILS only. The fast subset below runs in ``make test``;
the full zoo is marked slow (``make test-slow``); ``tools/zoo_table.py`` writes the table of
``docs/guide/zoo.md`` from the same runs.
"""

import math

import numpy as np
import pytest

from zoo import harness, models
from zoo.harness import Outcome, classify, compare

# Cheap cases (closed-form references, small data), all four algorithms, both dtypes, and
# both kinds of refusal-by-design.
FAST = [
    ("gaussian_mean", "FedZigZag", "float32"),
    ("gamma_beta", "FedZigZag", "float64"),
    ("gaussian_mean", "DADMMS", "float64"),
    ("one_row_clients", "DADMMS", "float32"),
    ("gaussian_mean_rescaled", "DSVGD", "float32"),
    ("eight_schools", "DSVGD", "float32"),
    ("linear_regression", "DPPVI", "float64"),
    ("eight_schools", "DPPVI", "float32"),
]
FULL = [run for run in harness.all_runs() if run not in FAST]


def _ids(runs):
    return ["-".join(run) for run in runs]


def _check(case, algorithm, dtype):
    outcome = harness.run_case(case, algorithm, dtype)
    print(outcome.report())
    assert outcome.outcome in ("agrees", "warns", "refuses"), outcome.report()
    if models.get_case(case).local_sites and algorithm in harness.GLOBAL_ONLY:
        assert outcome.outcome == "refuses", outcome.report()
    return outcome


@pytest.mark.parametrize("case, algorithm, dtype", FAST, ids=_ids(FAST))
def test_zoo_fast(case, algorithm, dtype):
    _check(case, algorithm, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("case, algorithm, dtype", FULL, ids=_ids(FULL))
def test_zoo(case, algorithm, dtype):
    _check(case, algorithm, dtype)


# -- the harness itself: it must be able to fail -------------------------------------------------


def test_zoo_has_what_the_issue_asks_for():
    cases = models.CASES
    assert len(cases) >= 12
    assert any(c.local_sites for c in cases.values())  # funnels with client-local latents
    assert {c.num_clients for c in cases.values()} >= {1, 100}
    assert sum(c.float64 for c in cases.values()) >= 4
    assert {"item 1", "item 4", "item 6"} <= {c.issue for c in cases.values()}


def test_closed_forms_match_the_model_they_describe():
    """The bimodal quadrature is symmetric, and the Gamma/Beta formulas match simulation."""
    mean, sd = models.CASES["bimodal"].closed_form()
    assert abs(mean[0]) < 1e-8 and 0.8 < sd[0] < 1.2
    mean, sd = models.CASES["gamma_beta"].closed_form()
    rng = np.random.default_rng(0)
    counts, flags = models._GB_COUNTS, models._GB_FLAGS
    lam = rng.gamma(2 + counts.sum(), 1 / (1 + counts.size), 400_000)
    p = rng.beta(2 + flags.sum(), 2 + flags.size - flags.sum(), 400_000)
    draws = np.stack([np.log(lam), np.log(p / (1 - p))], 1)
    np.testing.assert_allclose(draws.mean(0), mean, atol=5 * sd.max() / math.sqrt(400_000))
    np.testing.assert_allclose(draws.std(0), sd, rtol=0.01)
    X = models._CORR_X
    precision = X.T @ X + np.eye(20) / 100.0
    assert np.linalg.cond(precision) == pytest.approx(1e3, rel=1e-6)


def _ref(mean, sd, ess=np.inf):
    mean, sd = np.atleast_1d(mean).astype(float), np.atleast_1d(sd).astype(float)
    return {
        "mean": mean,
        "sd": sd,
        "ess_mean": np.full(mean.shape, ess),
        "ess_sd": np.full(mean.shape, ess),
        "kurtosis": np.full(mean.shape, 3.0),
    }


def _summary(mean, sd, ess):
    mean, sd = np.atleast_1d(mean).astype(float), np.atleast_1d(sd).astype(float)
    return {
        "coordinates": [f"x[{i}]" for i in range(mean.size)],
        "num_nonfinite": 0,
        "mean": mean,
        "sd": sd,
        "ess_mean": np.full(mean.shape, float(ess)),
        "ess_sd": np.full(mean.shape, float(ess)),
        "kurtosis": np.full(mean.shape, 3.0),
    }


def test_compare_tolerances_follow_the_monte_carlo_error():
    ref = _ref(0.0, 1.0)
    # exact sampler, ESS 400: MCSE 0.05, tolerance 4 x 0.05 = 0.2 sd
    assert compare(_summary(0.15, 1.0, 400), ref, "FedZigZag")[0]
    assert not compare(_summary(0.25, 1.0, 400), ref, "FedZigZag")[0]
    assert not compare(_summary(0.0, 1.0, 5), ref, "FedZigZag")[0]  # too few effective draws
    assert not compare(_summary(0.0, 1.3, 10_000), ref, "FedZigZag")[0]
    # approximate: half a posterior sd and a factor 2 on the sd, plus Monte Carlo error
    assert compare(_summary(0.45, 0.6, 100_000), ref, "DSVGD")[0]
    assert not compare(_summary(0.6, 1.0, 100_000), ref, "DSVGD")[0]
    assert not compare(_summary(0.0, 2.3, 100_000), ref, "DPPVI")[0]
    assert not compare(_summary(1e3, 1.0, 100_000), ref, "DADMMS")[0]  # runaway, finite


def test_dppvi_on_a_gaussian_posterior_must_reach_the_mean_field_optimum():
    ref = dict(_ref([0.0, 0.0], [1.0, 1.0]), mean_field=(np.zeros(2), np.array([0.5, 1.0])))
    summary = _summary([0.0, 0.0], [0.6, 0.9], 2000)
    assert compare(summary, ref, "DPPVI", {"loc": [0.05, 0.0], "scale": [0.52, 0.97]})[0]
    assert not compare(summary, ref, "DPPVI", {"loc": [0.15, 0.0], "scale": [0.5, 1.0]})[0]
    assert not compare(summary, ref, "DPPVI", {"loc": [0.0, 0.0], "scale": [0.6, 1.0]})[0]


def _record(status="completed", summary=None, error=None, warnings=()):
    return {
        "status": status,
        "phase": "run",
        "summary": summary,
        "error": error,
        "warnings": [{"category": "UserWarning", "message": m, "filename": "x"} for m in warnings],
    }


def test_classify_outcomes(monkeypatch):
    ref = _ref(0.0, 1.0)
    run = lambda record, case="gaussian_mean", algorithm="DSVGD", **kw: (
        classify(case, algorithm, "float32", record, 1.0, kw.get("timed_out", False), "", 10.0, ref).outcome
    )
    good, bad = _summary(0.1, 1.0, 10_000), _summary(3.0, 1.0, 10_000)
    assert run(_record(summary=good)) == "agrees"
    assert run(_record(summary=bad)) == "FAILS"
    assert run(_record(summary=bad, warnings=["lower the learning_rate"])) == "warns"
    # an exact sampler must agree: its warning does not excuse a wrong answer
    assert run(_record(summary=bad, warnings=["few effective draws"]), algorithm="FedZigZag") == "FAILS"
    assert run(None, timed_out=True) == "FAILS"
    assert run(None) == "FAILS"
    nonfinite = dict(good, num_nonfinite=3)
    assert run(_record(summary=nonfinite)) == "FAILS"
    worded = {"type": "ValueError", "message": "site(s) ['theta'] are client-local", "by_package": True}
    assert run(_record("error", error=worded)) == "refuses"
    assert run(_record("error", error=worded), case="eight_schools") == "refuses"
    unnamed = dict(worded, message="the model has a plate of clients")
    # an algorithm held to refusing client-local latents by name (none is today)
    monkeypatch.setattr(harness, "GLOBAL_ONLY", {"DPPVI"})
    assert run(_record("error", error=unnamed), case="eight_schools", algorithm="DPPVI") == "FAILS"
    assert run(_record(summary=good), case="eight_schools", algorithm="DPPVI") == "FAILS"  # must refuse by design
    crash = dict(worded, type="NameError", message="name 'x' is not defined")
    assert run(_record("error", error=crash)) == "FAILS"
    bare = dict(worded, by_package=False, type="TypeError", message="dot_general requires ...")
    assert run(_record("error", error=bare)) == "FAILS"


def test_a_jitted_loop_that_never_ends_is_killed_at_the_budget():
    outcome = harness.run_case("gaussian_mean", "_hang", "float32", budget=10.0)
    assert isinstance(outcome, Outcome)
    assert outcome.outcome == "FAILS" and "hang" in outcome.detail
    assert outcome.seconds < 25.0
