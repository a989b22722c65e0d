"""The whole privacy statement on every private result: epsilon and delta, the accountant and
its tolerance, the relation and the unit, the sampling as implemented (and accounted as such),
noise multipliers, clip norms, steps and rounds, whether the randomness was client-private and
what is not covered; in ``result.privacy``, its ``str`` and the ArviZ attrs."""

import pytest

import jax

import numpyro_fed as nf
from numpyro_fed.privacy.accounting import compute_epsilon, dpsgd_event, gaussian_event

from models import PRIVATE_CLIENTS, PRIVATE_ROWS, private_logistic, private_logistic_data

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

M, ROWS = PRIVATE_CLIENTS, PRIVATE_ROWS


model = private_logistic


@pytest.fixture(scope="module")
def data():
    return private_logistic_data()


def planned(data, **kw):
    """The guarantee a run of 2 rounds would have (``init`` plans and accounts it)."""
    method = nf.DPPVI(model, num_local_steps=5, progress_bar=False, **kw)
    method.init(jax.random.PRNGKey(0), *data, num_rounds=2)
    return method._plan.privacy


def test_poisson_dpsgd_statement_is_what_the_code_does(data):
    privacy = planned(data, dp="dpsgd", noise_multiplier=1.5, sampling_rate=0.2, clip_norm=2.0)
    # accounted as Poisson subsampling (each row independently, as the clients draw batches) at
    # the delta left after the share that covers the cap on batch sizes
    expected = compute_epsilon(dpsgd_event(1.5, 10, dataset_size=30, sampling_rate=0.2), 1e-5 * (1 - 1e-6))
    assert privacy.epsilon == pytest.approx(expected, rel=1e-12) and privacy.delta == 1e-5
    assert privacy.reserved_delta == pytest.approx(1e-11)
    assert privacy.accountant.startswith("PLD") and "upper-bounds" in privacy.tolerance
    assert privacy.sampling.startswith("Poisson") and "0.2" in privacy.sampling
    assert privacy.noise_multipliers == (1.5,) * M and privacy.clip_norms == (2.0,)
    assert (privacy.steps, privacy.rounds) == (10, 2)
    assert privacy.unit.startswith("example-level") and "replaced" in privacy.neighbouring
    assert not privacy.client_private_randomness and "tuning" in privacy.not_covered
    text = str(privacy)
    for part in ("accountant: PLD", "sampling: Poisson", "noise multiplier(s): 1.5", "clip norm(s): 2", "10 noised"):
        assert part in text, part
    assert "budget" not in text  # none was drawn from


def test_fixed_size_batches_are_accounted_without_replacement(data):
    privacy = planned(
        data, dp="dpsgd", noise_multiplier=1.5, sampling="without_replacement", sampling_rate=0.2, clip_norm=1.0
    )
    assert privacy.accountant.startswith("RDP") and "fixed-size batches of 6 row(s)" in privacy.sampling
    expected = compute_epsilon(
        dpsgd_event(1.5, 10, dataset_size=30, batch_size=6, sampling="without_replacement"), 1e-5
    )
    assert privacy.epsilon == pytest.approx(expected, rel=1e-12) and privacy.reserved_delta == 0.0


def test_update_perturbation_and_automatic_clip_norms(data):
    privacy = planned(data, dp="local_avg", noise_multiplier=3.0, num_shards=2, clip_norm=0.5)
    assert privacy.epsilon == pytest.approx(compute_epsilon(gaussian_event(3.0, 2), 1e-5), rel=1e-12)
    assert (privacy.steps, privacy.rounds, privacy.clip_norms) == (2, 2, (0.5,))
    assert privacy.sampling.startswith("none accounted") and "2 fixed shards" in privacy.sampling
    auto = planned(data, dp="dpsgd", noise_multiplier=1.5, sampling_rate=0.2)  # clip norms chosen per client
    assert len(auto.clip_norms) == 2 * M and all(c > 0 for c in auto.clip_norms)
    assert "units of q's scale" in auto.method


def test_the_statement_is_in_the_arviz_attrs_and_netcdf_safe(data):
    result = nf.DPPVI(
        model, dp="local_avg", noise_multiplier=3.0, num_shards=2, num_local_steps=5, progress_bar=False
    ).run(jax.random.PRNGKey(0), 2, *data)
    attrs = nf.to_inference_data(result).attrs
    assert attrs["privacy_epsilon"] == result.privacy.epsilon
    assert attrs["privacy_statement"] == str(result.privacy)
    assert attrs["privacy_client_private_randomness"] == 0
    assert attrs["privacy_noise_multipliers"] == [3.0] * M and attrs["privacy_steps"] == 2
    for name, value in attrs.items():
        assert isinstance(value, (str, int, float, list)), name
    assert "client_private_randomness=False" in repr(result.privacy)


def test_fedzigzag_statement_says_per_message_and_closed_form():
    _, guarantee = nf.privacy.switching_time_guarantee(2.0, 0.0, 1e-5, epsilon=1.0)
    assert "closed form" in guarantee.accountant and "per message" in guarantee.scope
    assert "not composed" in guarantee.tolerance and "randomness: NOT client-private" in str(guarantee)
