"""``nf.PrivacyBudget``: several runs on the same data draw from one budget, composed by the
accountant; a run that would exceed it is refused before it starts; each run's guarantee names
the budget."""

import pytest

import jax

import numpyro_fed as nf
from numpyro_fed.privacy.accounting import compute_epsilon, dpsgd_event, gaussian_event

from models import PRIVATE_CLIENTS, PRIVATE_ROWS, private_logistic, private_logistic_data

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # short runs: fits are not the point

M, ROWS, SIGMA = PRIVATE_CLIENTS, PRIVATE_ROWS, 8.0


model = private_logistic


@pytest.fixture(scope="module")
def data():
    return private_logistic_data()


def local_avg(budget, sigma=SIGMA, **kw):
    return nf.DPPVI(
        model,
        dp="local_avg",
        noise_multiplier=sigma,
        num_shards=2,
        num_local_steps=5,
        progress_bar=False,
        budget=budget,
        **kw,
    )


def test_runs_compose_and_the_one_past_the_budget_is_refused_before_it_starts(data):
    # dp-accounting's PLD, called directly: 2 rounds of noise 8 spend 1.356; 4 rounds 1.993;
    # 6 rounds 2.502 (delta 1e-5, substitution). A budget of 2.2 holds two 2-round runs, not three.
    alone, two, three = (compute_epsilon(gaussian_event(SIGMA, k), 1e-5) for k in (2, 4, 6))
    assert alone < two < 2.2 < three
    budget = nf.PrivacyBudget(2.2, 1e-5, name="trial")
    first = local_avg(budget).run(jax.random.PRNGKey(0), 2, *data)
    assert first.privacy.epsilon == pytest.approx(alone, rel=1e-9)
    assert budget.spent == pytest.approx(alone, rel=1e-3)
    assert "'trial'" in first.privacy.budget and "run 1" in first.privacy.budget
    assert "budget: drew from PrivacyBudget 'trial'" in str(first.privacy)
    second = local_avg(budget)
    second.init(jax.random.PRNGKey(1), *data, num_rounds=2)  # a run is charged as it starts
    assert budget.spent == pytest.approx(two, rel=1e-3)  # composed, not added (alone * 2 = 2.71)
    assert second._plan.privacy.budget.startswith("drew from") and "run 2" in second._plan.privacy.budget
    third = local_avg(budget)
    with pytest.raises(ValueError, match=r"PrivacyBudget 'trial'.*would take it to epsilon=2\.5.*not started"):
        third.run(jax.random.PRNGKey(2), 2, *data)
    assert not third.federation.started and len(budget.runs) == 2
    assert budget.spent == pytest.approx(two, rel=1e-3)
    # a run that fits what is left (more noise) is still accepted
    local_avg(budget, sigma=40.0).init(jax.random.PRNGKey(3), *data, num_rounds=1)
    assert len(budget.runs) == 3 and budget.spent <= 2.2


def test_a_budget_composes_dpsgd_with_update_perturbation_and_reserves_the_poisson_cap(data):
    budget = nf.PrivacyBudget(10.0, 1e-5)
    dpsgd = nf.DPPVI(
        model,
        dp="dpsgd",
        noise_multiplier=2.0,
        sampling_rate=0.2,
        clip_norm=1.0,
        num_local_steps=5,
        progress_bar=False,
        budget=budget,
    )
    dpsgd.init(jax.random.PRNGKey(0), *data, num_rounds=2)
    local_avg(budget).init(jax.random.PRNGKey(1), *data, num_rounds=2)
    # independent check: the same events composed by dp-accounting directly, at the delta the
    # Poisson cap leaves
    import dp_accounting

    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dpsgd_event(2.0, 10, dataset_size=30, sampling_rate=0.2))
    accountant.compose(gaussian_event(SIGMA, 2))
    assert budget.spent == pytest.approx(accountant.get_epsilon(1e-5 * (1 - 1e-6)), rel=1e-3)


def test_budget_inputs_are_checked(data):
    with pytest.raises(ValueError, match="epsilon"):
        nf.PrivacyBudget(0.0, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        nf.PrivacyBudget(1.0, 1.5)
    with pytest.raises(ValueError, match="dp=None spends nothing"):
        nf.DPPVI(model, budget=nf.PrivacyBudget(1.0, 1e-5))
    with pytest.raises(TypeError, match="PrivacyBudget"):
        nf.DPPVI(model, dp="local_avg", noise_multiplier=1.0, budget=1.0)
    add_remove = nf.PrivacyBudget(5.0, 1e-5, neighbouring="add_remove")
    with pytest.raises(ValueError, match="neighbouring='add_remove'"):
        local_avg(add_remove).init(jax.random.PRNGKey(0), *data, num_rounds=1)
    assert add_remove.runs == [] and repr(add_remove).endswith("spent=0, runs=0)")
