"""From a NumPyro model to what the SVGD family's cores take: flat gradient functions, prior
draws, minibatch gradient estimates."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.initialization import init_to_sample

__all__ = [
    "FlatGradients",
    "data_plate",
    "flat_gradients",
    "initial_particles",
    "minibatch_client_grad",
    "named_init_strategy",
    "prior_draws",
]


class FlatGradients(NamedTuple):
    """Gradients of a :class:`~numpyro_fed.FederatedPotential` on flat ``(d,)`` vectors.

    :ivar prior_grad: ``(d,) -> (d,)``, gradient of the prior potential ``-log p_0``.
    :ivar client_grad: ``((d,), block) -> (d,)``, gradient of a client's term given its
        data block.
    """

    prior_grad: Callable
    client_grad: Callable


def flat_gradients(fp) -> FlatGradients:
    """The :class:`FlatGradients` of ``fp``: the gradients of its flat adapter
    (:meth:`FederatedPotential.flat() <numpyro_fed.FederatedPotential.flat>`).

    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> fp = nf.split_potential(model, (jnp.array([1.0, 2.0]),))
    >>> grads = flat_gradients(fp)
    >>> grads.prior_grad(jnp.array([0.5])).tolist(), grads.client_grad(jnp.array([0.5]), fp.client_block(1)).tolist()
    ([0.5], [-1.5])
    """
    flat = fp.flat()
    return FlatGradients(jax.grad(flat.prior_potential), jax.grad(flat.client_potential))


def data_plate(fp, needed_by: str) -> str:
    """The name of the model's one federated data plate; ``needed_by`` names what needs it."""
    plates = [p.name for p in fp.plates.values() if p.holds_data]
    if len(plates) != 1:
        raise ValueError(f"{needed_by} needs a model with one federated data plate, found {plates}")
    return plates[0]


def minibatch_client_grad(fp, batch_size: int) -> Callable:
    """``(x (N, d), block, key) -> (N, d)``: ``grad L_k`` at every particle estimated from
    ``batch_size`` of the client's rows drawn without replacement (the same rows for every
    particle), scaled by ``n_k / batch_size``. A client with fewer rows uses them all.

    The ``stochastic_client_grad`` of the cores, for a model with one federated data plate.
    """
    plate, row_log_likelihood = data_plate(fp, "batch_size"), fp.flat().row_log_likelihood

    def loss(y, rows, weights, scale):
        return -scale * jnp.sum(weights * row_log_likelihood(y, rows))

    grad = jax.vmap(jax.grad(loss), in_axes=(0, None, None, None))

    def stochastic_grad(x, block, key):
        valid = block["valid"][plate]
        count = min(batch_size, valid.shape[0])
        priority = jnp.where(valid, jax.random.uniform(key, valid.shape), -1.0)
        positions = lax.top_k(priority, count)[1]
        weights = valid[positions].astype(x.dtype)
        scale = jnp.sum(valid).astype(x.dtype) / jnp.maximum(jnp.sum(weights), 1.0)
        rows = jax.tree.map(lambda r: r[positions], block["rows"])
        return grad(x, rows, weights, scale)

    return stochastic_grad


def prior_draws(model, fp, rng_key, args, kwargs, num: int) -> jax.Array:
    """``(num, d)`` draws of the global latents from the model's prior, flat and unconstrained
    (:func:`initial_particles` with NumPyro's ``init_to_sample``: a site whose prior cannot be
    sampled, e.g. ``ImproperUniform``, is drawn uniformly in ``(-2, 2)`` unconstrained)."""
    return initial_particles(model, fp, rng_key, args, kwargs, num, init_to_sample)


def named_init_strategy(init_strategy):
    """``init_strategy`` that raises a ``ValueError`` naming the site it cannot initialise
    (rather than, e.g., NumPyro's bare ``NotImplementedError`` of a flat prior's sample)."""
    if getattr(init_strategy, "names_sites", False):
        return init_strategy

    def strategy(site):
        try:
            value = init_strategy(site)
        except (NotImplementedError, ValueError, TypeError) as e:
            raise ValueError(
                f"init_strategy cannot initialise the particles at site '{site['name']}' "
                f"({type(site['fn']).__name__}): {type(e).__name__} {e}. Pass init_strategy=init_to_uniform, "
                "or init_particles="
            ) from e
        # a discrete site has no init value (enumerated, or refused by the potential's checks)
        discrete = getattr(getattr(site.get("fn"), "support", None), "is_discrete", False)
        if value is None and site["type"] == "sample" and not site["is_observed"] and not discrete:
            raise ValueError(
                f"init_strategy gives no value at site '{site['name']}' ({type(site['fn']).__name__}): "
                "pass init_strategy=init_to_uniform, or init_particles="
            )
        return value

    strategy.names_sites = True
    return strategy


def initial_particles(model, fp, rng_key, args, kwargs, num: int, init_strategy=init_to_sample) -> jax.Array:
    """``(num, d)`` initial particles, flat and unconstrained: one run of the NumPyro init
    strategy ``init_strategy`` per particle (``init_to_sample``: prior draws, and
    NumPyro's uniform ``(-2, 2)`` on the unconstrained space where the prior cannot be
    sampled, e.g. a flat ``ImproperUniform``; ``init_to_uniform``; ``init_to_median``, ...).
    Coordinates in which every particle comes out equal (e.g. ``init_to_median``,
    ``init_to_value``) are spread by a uniform ``(-1, 1)`` jitter around that value: SVGD
    cannot separate coinciding particles; a coordinate that is infinite unconstrained (a
    float32 draw at the edge of its support) is drawn uniformly in ``(-2, 2)`` instead. A
    strategy that cannot initialise a site raises a ``ValueError`` naming it.

    In deployment (``fp.deployed``: the rows are on the clients; ``args`` and ``kwargs`` are
    empty) the model runs on :attr:`FederatedPotential.stand_in_arguments
    <numpyro_fed.FederatedPotential.stand_in_arguments>`, zeros in place of the rows: the prior
    of global latents does not depend on the rows (:func:`~numpyro_fed.split_potential` checks
    it), and no row crosses.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.ImproperUniform(dist.constraints.real, (), ()))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> y = jnp.array([1.0, 2.0])
    >>> x = initial_particles(model, nf.split_potential(model, (y,)), jax.random.PRNGKey(0), (y,), {}, 5)
    >>> x.shape, bool(jnp.all(jnp.abs(x) < 2))
    ((5, 1), True)
    """
    names = list(fp.init_params)
    stand_in = getattr(fp, "stand_in_arguments", None)
    if fp.deployed and not (args or kwargs) and stand_in is not None:
        args, kwargs = stand_in
    strategy = named_init_strategy(init_strategy)

    # One compiled program, the data arrays as its arguments (not constants; other arguments,
    # e.g. sizes, stay static): run op by op, the model's likelihood would be evaluated, and
    # each operation compiled, for nothing.
    leaves, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

    def one(key, arrays):
        full = list(leaves)
        for i, array in zip(dynamic, arrays):
            full[i] = array
        model_args, model_kwargs = jax.tree_util.tree_unflatten(treedef, full)
        tr = trace(substitute(seed(model, key), substitute_fn=strategy)).get_trace(*model_args, **model_kwargs)
        z = {name: biject_to(tr[name]["fn"].support).inv(tr[name]["value"]) for name in names}
        return fp.ravel(z)

    k_draw, k_jitter = jax.random.split(rng_key)
    draw = jax.jit(jax.vmap(one, in_axes=(0, None)))
    particles = draw(jax.random.split(k_draw, num), [leaves[i] for i in dynamic])
    k_jitter, k_uniform = jax.random.split(k_jitter)
    # A draw at the edge of its support (e.g. a float32 prior draw of ordered values that
    # coincide) is infinite unconstrained: NumPyro's uniform (-2, 2) there instead.
    uniform = jax.random.uniform(k_uniform, particles.shape, particles.dtype, -2.0, 2.0)
    particles = jnp.where(jnp.isfinite(particles), particles, uniform)
    if num > 1:
        equal = jnp.all(particles == particles[:1], axis=0)
        jitter = jax.random.uniform(k_jitter, particles.shape, particles.dtype, -1.0, 1.0)
        particles = jnp.where(equal, particles + jitter, particles)
    return particles
