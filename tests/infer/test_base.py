"""The shared face: build_potential, the global-latents check, FlatPotential, run_rounds, RunResult."""

from typing import NamedTuple

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.infer.base import RunResult, VariationalMethod, build_potential, check_global_latents
from numpyro_fed.infer.rounds import run_rounds


def normal_mean(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def random_effects(y, client):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with nf.federated_plate("clients", 2, clients=2):
        u = numpyro.sample("u", dist.Normal(mu, 1.0))
    with nf.federated_plate("data", y.shape[0], clients=client):
        numpyro.sample("y", dist.Normal(u[client], 1.0), obs=y)


def test_build_potential_passes_partition_and_init_strategy_through():
    from numpyro.infer.initialization import init_to_value

    y = jnp.arange(6.0)
    fp = build_potential(normal_mean, (y,), partition={"data": 3}, init_strategy=init_to_value(values={"mu": 1.25}))
    assert fp.num_clients == 3
    assert float(fp.init_params["mu"]) == 1.25


def test_one_message_for_client_local_latents():
    y, client = jnp.arange(4.0), jnp.array([0, 0, 1, 1])
    fp = nf.split_potential(random_effects, (y, client))
    with pytest.raises(
        ValueError, match=r"Toy infers global latent variables only; site\(s\) \['u'\] are client-local"
    ):
        check_global_latents(fp, "Toy")
    with pytest.raises(ValueError, match="global latent variables only"):
        build_potential(random_effects, (y, client), global_latents_only="Toy")


def test_flat_potential_sums_to_the_potential():
    y = jnp.arange(6.0)
    fp = nf.split_potential(normal_mean, (y,), partition={"data": [[0, 1], [2, 3, 4, 5]]})
    flat = fp.flat()
    x = jnp.array([0.3])
    assert flat.num_latent == 1
    np.testing.assert_allclose(flat.potential(x), fp.potential(fp.unravel(x)), rtol=1e-12)
    np.testing.assert_allclose(flat.prior_potential(x), fp.prior_potential(fp.unravel(x)), rtol=1e-12)
    rows = jax.tree.map(lambda a: a[1], fp.client_data)
    valid = rows["valid"]["data"]
    total = jnp.sum(jnp.where(valid, flat.row_log_likelihood(x, rows["rows"]), 0.0))
    np.testing.assert_allclose(-total, flat.client_potential(x, rows), rtol=1e-12)
    assert float(flat.postprocess(x)["mu"]) == pytest.approx(0.3)


def test_run_rounds_stacks_metrics_and_names_the_diverging_round():
    def update(key, x):
        return x * 10.0, {"loss": x, "noise": jax.random.normal(key, (2,))}

    state, metrics = run_rounds(
        update, jax.random.PRNGKey(0), jnp.float64(1.0), 3, record=lambda s, info: info, progress_bar=False
    )
    assert float(state) == 1000.0
    assert metrics["loss"].tolist() == [1.0, 10.0, 100.0]
    assert metrics["noise"].shape == (3, 2) and metrics["wall_time"].shape == (3,)
    # one key per round: the rounds' noises differ
    assert not np.allclose(metrics["noise"][0], metrics["noise"][1])
    with pytest.raises(FloatingPointError, match="Toy diverged: non-finite state after round 2 of 5; lower it") as info:
        run_rounds(
            lambda k, x: (x * 1e200, {"loss": x}),
            jax.random.PRNGKey(0),
            jnp.float64(1e100),
            5,
            record=lambda s, info: info,
            progress_bar=False,
            desc="Toy",
            divergence_advice="lower it",
        )
    # the error carries the rounds completed before the non-finite one
    checkpoint = info.value.state
    assert (checkpoint.rounds_done, checkpoint.num_rounds, float(checkpoint.state)) == (1, 5, 1e300)
    assert checkpoint.metrics["loss"].tolist() == [1e100] and checkpoint.metrics["wall_time"].shape == (1,)


class MeanState(NamedTuple):
    loc: jax.Array


class MeanInfo(NamedTuple):
    loss: jax.Array


class AverageOfClientMeans(VariationalMethod):
    """A point mass at the average of the clients' gradient steps (enough to test the face)."""

    repr_fields = ("step_size",)

    def __init__(self, model, *, step_size=0.1, **kwargs):
        super().__init__(model, **kwargs)
        self.step_size = step_size

    def init(self, rng_key, *args, **kwargs):
        fp = self.build_potential(args, kwargs)
        return MeanState(fp.ravel(fp.init_params))

    def update(self, rng_key, state, *args, **kwargs):
        flat = self.federated_potential.flat()
        grads = jax.vmap(jax.grad(flat.client_potential), in_axes=(None, 0))(state.loc, flat.client_data)
        loc = state.loc - self.step_size * (jnp.sum(grads, 0) + jax.grad(flat.prior_potential)(state.loc))
        return MeanState(loc), MeanInfo(self.evaluate(MeanState(loc)))

    def evaluate(self, state, *args, **kwargs):
        return self.federated_potential.flat().potential(state.loc)

    def get_samples(self, rng_key, result, num_samples=None):
        x = jnp.broadcast_to(result.state.loc, (num_samples or 1,) + result.state.loc.shape)
        return jax.vmap(self.federated_potential.flat().postprocess)(x)


def test_a_variational_method_gets_run_result_repr_and_inference_data():
    y = jnp.arange(6.0)
    method = AverageOfClientMeans(normal_mean, step_size=0.05, partition={"data": 2}, progress_bar=False)
    assert repr(method) == "AverageOfClientMeans(normal_mean, step_size=0.05)"
    result = method.run(jax.random.PRNGKey(0), 100, y)
    assert isinstance(result, RunResult) and result.method is method and result.privacy is None
    assert result.metrics["loss"].shape == (100,)
    assert result.metrics["loss"][-1] < result.metrics["loss"][0]
    # the MAP of mu: sum(y) / (n + 1/4)
    assert float(result.state.loc[0]) == pytest.approx(15.0 / 6.25, rel=1e-6)
    again = method.run(jax.random.PRNGKey(1), 1, y, init_state=result.state)
    assert float(again.state.loc[0]) == pytest.approx(15.0 / 6.25, rel=1e-6)
    idata = nf.to_inference_data(result, num_samples=5)
    assert idata.posterior["mu"].shape == (1, 5)
    assert idata.sample_stats["loss"].dims == ("round",)
    assert idata.attrs["algorithm"] == "AverageOfClientMeans" and idata.attrs["num_clients"] == 2
