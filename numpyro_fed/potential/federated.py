"""Exact splitting of a NumPyro model's potential energy into a prior term and one term per client.

The potential energy NumPyro samples from (:func:`numpyro.infer.util.potential_energy`) is
``-log p(theta, data)`` on the unconstrained latent space, including the log-Jacobians of the
transforms. :func:`split_potential` writes it as

    potential(z) = prior_potential(z) + sum_m client_potentials(z)[m]

where the prior term holds every site outside federated plates (and their Jacobians), and
client ``m``'s term holds the rows of every federated plate that ``m`` owns: its data rows,
its client-local latent variables and their Jacobians, and its enumerated discrete latents.

How it stays private: the arguments of the model whose leading axis runs over the rows of a
federated data plate are cut into per-client blocks, stacked on a leading client axis and
padded to a common length (the padding repeats one of the client's own rows and is masked).
Client ``m``'s potential is one function that receives only block ``m``; all clients are
evaluated at once with ``jit(vmap(...))``. The server's prior term runs the model with the
client rows replaced by a one-row placeholder and is checked, at construction, not to depend
on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from functools import partial
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

import numpyro.distributions as dist
from numpyro.distributions.distribution import validation_enabled
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.initialization import init_to_uniform
# Private NumPyro helpers, for want of public ones: _unconstrain_reparam is what NumPyro's own
# potential_energy uses to map unconstrained values to sites (with the Jacobian terms), and
# _guess_max_plate_nesting is what its MCMC uses to size enumeration; re-implementing them would
# let the split drift from NumPyro's potential, which the split must equal to round-off.
from numpyro.infer.util import (
    _guess_max_plate_nesting,
    _unconstrain_reparam,
    log_density as _numpyro_log_density,
)
from numpyro.primitives import Messenger

from numpyro_fed.plate import _override_plate_sizes

from numpyro_fed.potential.trace import (
    PlateInfo,
    _discovery_trace,
    _in_plates,
    _analyse_trace,
    _plate_axis,
    _common_num_clients,
    _find_row_leaves,
    _check_finite_arguments,
    _describe_leaves,
    _unconstrained_init,
    _owner_of_coordinates,
    _scatter_rows,
    _data_free_outputs,
    _validate_split,
)

__all__ = ["FederatedPotential", "FlatPotential", "split_potential"]


class _mask_unowned(Messenger):
    """Masks the log-density of every site, or row of a site, that the current view does not own.

    ``masks`` maps a federated plate name to a row mask (or a Python bool); sites outside
    federated plates get ``global_mask``. Enumerated discrete sites are left unmasked: they
    are normalised, so once everything depending on them is masked they sum out to one.
    """

    def __init__(self, fn=None, *, masks: Mapping[str, Any], global_mask: bool, enumerated: bool):
        self.masks = masks
        self.global_mask = global_mask
        self.enumerated = enumerated
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "sample":
            return
        if self.enumerated and not msg["is_observed"] and msg["fn"].has_enumerate_support:
            return
        frames = [f for f in msg["cond_indep_stack"] if f.name in self.masks]
        if not frames:
            mask = self.global_mask
        else:
            frame = frames[0]
            mask = self.masks[frame.name]
            if not isinstance(mask, bool):
                mask = jnp.reshape(mask, (-1,) + (1,) * (-frame.dim - 1))
        if mask is True:
            return
        msg["fn"] = msg["fn"].mask(mask)


class _unconstrain(substitute):
    """Substitutes unconstrained values exactly as :func:`numpyro.infer.util.potential_energy`."""

    def __init__(self, fn, params):
        super().__init__(fn, substitute_fn=partial(_unconstrain_reparam, params))


class FlatPotential(NamedTuple):
    """A :class:`FederatedPotential`'s pure functions on the flat ``(d,)`` unconstrained vector
    ``x`` (the order of :meth:`FederatedPotential.ravel`): what an algorithm's core works
    with. Get it with :meth:`FederatedPotential.flat`. None is jit-compiled: the core does
    that (and ``vmap``s the client functions over :attr:`client_data`).

    :ivar prior_potential: ``x -> scalar``, the server's term.
    :ivar client_potential: ``(x, block) -> scalar``, one client's term given its block
        (one slice of :attr:`client_data`).
    :ivar row_log_likelihood: ``(x, rows) -> (R,)``, each row's log-likelihood (see
        :attr:`FederatedPotential.row_log_likelihood_fn`).
    :ivar postprocess: ``x -> dict`` of constrained values by site.
    :ivar client_data: the clients' stacked blocks (leading axis ``M``).
    :ivar int num_latent: ``d``.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> flat = nf.split_potential(model, (jnp.arange(4.0),)).flat()
    >>> x = jnp.zeros(flat.num_latent)
    >>> grads = jax.vmap(jax.grad(flat.client_potential), in_axes=(None, 0))(x, flat.client_data)
    >>> grads.shape  # one gradient per client
    (2, 1)
    """

    prior_potential: Callable
    client_potential: Callable
    row_log_likelihood: Callable
    postprocess: Callable
    client_data: Any
    num_latent: int

    def potential(self, x):
        """``prior_potential(x) + sum_m client_potential(x, block_m)``."""
        clients = jax.vmap(self.client_potential, in_axes=(None, 0))(x, self.client_data)
        return self.prior_potential(x) + jnp.sum(clients)


class FederatedPotential:
    """A model's potential energy split into a prior term and one term per client.

    Build it with :func:`split_potential`. All functions take the unconstrained latent
    values ``z`` as a dict keyed by site name (the layout of NumPyro's ``init_params``) and
    are jit-compiled; all clients are evaluated together with ``vmap``.

    :ivar int num_clients: ``M``.
    :ivar numpy.ndarray client_sizes: rows per client of the first federated data plate.
    :ivar dict plates: :class:`PlateInfo` of every federated plate, by name.
    :ivar dict init_params: a valid initial point (unconstrained, dict by site).
    :ivar coordinate_owner: ``(d,)`` int array: the client owning each coordinate of the
        flattened ``z`` (see :meth:`ravel`), ``-1`` for global coordinates.
    :ivar dict coordinate_owner_tree: the same, shaped like ``z``.
    :ivar client_data: the clients' stacked, padded blocks (a pytree with leading axis ``M``).
        Block ``m`` is the only input of client ``m``'s function that carries data.
    :ivar bool enumerated: whether discrete latents are marginalised by enumeration.
    :ivar dict row_arguments: the model arguments cut per client (path -> plate name).
    :ivar prior_potential_fn: the pure, un-jitted ``z -> prior term`` (server side).
    :ivar client_potential_fn: the pure, un-jitted ``(z, block) -> client term``, where
        ``block`` is one client's slice of :attr:`client_data`; algorithms ``vmap`` it (or
        its derivatives) over ``client_data`` themselves.
    :ivar row_log_likelihood_fn: the pure ``(z, rows) -> (num_rows,)`` log-likelihood of
        each row of a block of data rows (``rows`` has the layout of ``block["rows"]``
        with any number of rows, e.g. one client's minibatch). Padding is not masked: the
        caller weights rows by ``block["valid"]``. For models with one federated data plate
        and global latents only; it is what per-example gradients (DP-SGD) differentiate.
        Over a client's valid rows it sums to minus that client's potential.
    :ivar postprocess_fn: ``z -> dict`` of constrained values of every latent site and of the
        deterministic sites that do not depend on client data (as NumPyro's
        ``postprocess_fn``; row-local latents are constrained by their clients).
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)
        self._ravel_unravel = ravel_pytree(self.init_params)[1]
        self._jit_prior = jax.jit(self.prior_potential_fn)
        self._jit_prior_grad = jax.jit(jax.value_and_grad(self.prior_potential_fn))
        vmapped = jax.vmap(self.client_potential_fn, in_axes=(None, 0))
        self._jit_clients = jax.jit(vmapped)
        self._jit_client_grads = jax.jit(
            jax.vmap(jax.value_and_grad(self.client_potential_fn), in_axes=(None, 0))
        )

        def total(z, client_data):
            return self.prior_potential_fn(z) + jnp.sum(vmapped(z, client_data))

        self._jit_total = jax.jit(total)
        self._jit_total_grad = jax.jit(jax.value_and_grad(total))

    # -- values ---------------------------------------------------------------------------
    def prior_potential(self, z) -> jax.Array:
        """The server's term: sites outside federated plates and their log-Jacobians."""
        return self._jit_prior(z)

    def client_potentials(self, z) -> jax.Array:
        """Each client's term, shape ``(M,)``."""
        return self._jit_clients(z, self.client_data)

    def potential(self, z) -> jax.Array:
        """``prior_potential(z) + client_potentials(z).sum()``: NumPyro's potential energy."""
        return self._jit_total(z, self.client_data)

    # -- gradients ------------------------------------------------------------------------
    def prior_grad(self, z):
        """Gradient of :meth:`prior_potential`, shaped like ``z``."""
        return self._jit_prior_grad(z)[1]

    def client_grads(self, z):
        """Per-client gradients: like ``z`` with a leading axis of size ``M``."""
        return self._jit_client_grads(z, self.client_data)[1]

    def grad(self, z):
        """Gradient of :meth:`potential`."""
        return self._jit_total_grad(z, self.client_data)[1]

    def value_and_grad(self, z):
        """``(potential(z), grad(z))`` in one pass."""
        return self._jit_total_grad(z, self.client_data)

    def client_values_and_grads(self, z):
        """``(client_potentials(z), client_grads(z))`` in one pass."""
        return self._jit_client_grads(z, self.client_data)

    # -- layout ---------------------------------------------------------------------------
    def ravel(self, z) -> jax.Array:
        """Flattens ``z`` to a ``(d,)`` vector in the order of :attr:`coordinate_owner`."""
        return ravel_pytree(z)[0]

    def unravel(self, flat) -> dict:
        """Inverse of :meth:`ravel`."""
        return self._ravel_unravel(flat)

    def flat(self) -> FlatPotential:
        """The potential's pure functions on the flat unconstrained vector (the one adapter
        every algorithm's core uses; see :class:`FlatPotential`)."""
        unravel = self.unravel
        return FlatPotential(
            prior_potential=lambda x: self.prior_potential_fn(unravel(x)),
            client_potential=lambda x, block: self.client_potential_fn(unravel(x), block),
            row_log_likelihood=lambda x, rows: self.row_log_likelihood_fn(unravel(x), rows),
            postprocess=lambda x: self.postprocess_fn(unravel(x)),
            client_data=self.client_data,
            num_latent=self.num_latent,
        )

    @property
    def num_latent(self) -> int:
        """Dimension ``d`` of the unconstrained latent space."""
        return int(self.coordinate_owner.shape[0])

    def __repr__(self) -> str:
        return (
            f"FederatedPotential(num_clients={self.num_clients}, "
            f"client_sizes={self.client_sizes.tolist()}, num_latent={self.num_latent}, "
            f"plates={list(self.plates)})"
        )


def split_potential(
    model: Callable,
    model_args: tuple = (),
    model_kwargs: dict | None = None,
    *,
    partition: Mapping[str, Any] | None = None,
    init_strategy: Callable = init_to_uniform,
    rng_key: jax.Array | None = None,
    validate: bool = True,
) -> FederatedPotential:
    """Splits ``model``'s potential energy into a prior term and one term per client.

    :param model: a NumPyro model with at least one :class:`~numpyro_fed.federated_plate`
        (or plain ``numpyro.plate`` named in ``partition``).
    :param tuple model_args: the model's positional arguments. Arguments whose leading axis
        has the size of a federated data plate are taken as the clients' rows and cut per
        client.
    :param dict model_kwargs: the model's keyword arguments (same rule).
    :param dict partition: federate an unmodified model from outside: ``{plate_name:
        clients}`` with ``clients`` in any form ``federated_plate`` accepts.
    :param init_strategy: NumPyro init strategy for :attr:`FederatedPotential.init_params`.
    :param rng_key: key for the initial point (default ``PRNGKey(0)``).
    :param bool validate: check, at the initial point, that the prior term does not depend
        on client data and that the split sums to NumPyro's potential energy.
    :return: a :class:`FederatedPotential`.

    **Example**

    .. doctest::

        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> from numpyro.infer.util import initialize_model
        >>> def model(X, y=None):
        ...     w = numpyro.sample("w", dist.Normal(0, 1).expand([2]).to_event(1))
        ...     with nf.federated_plate("data", X.shape[0], clients=[[0, 2, 4], [1, 3]]):
        ...         numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = jax.random.normal(jax.random.PRNGKey(1), (5, 2)); y = (X[:, 0] > 0) * 1.0
        >>> fp = nf.split_potential(model, (X, y))
        >>> z = fp.init_params
        >>> ref = initialize_model(jax.random.PRNGKey(0), model, model_args=(X, y)).potential_fn(z)
        >>> bool(jnp.allclose(fp.prior_potential(z) + fp.client_potentials(z).sum(), ref))
        True
    """
    model_kwargs = dict(model_kwargs or {})
    partition = dict(partition or {})
    if rng_key is None:
        rng_key = jax.random.PRNGKey(0)

    _check_finite_arguments(model_args, model_kwargs)
    model_trace = _discovery_trace(model, model_args, model_kwargs, rng_key, init_strategy)
    plates, latent_sites, enumerated = _analyse_trace(model_trace, partition)
    num_clients = _common_num_clients(plates)

    leaves, treedef = jax.tree_util.tree_flatten((tuple(model_args), model_kwargs))
    row_leaves = _find_row_leaves(leaves, plates)

    # The model NumPyro would build its potential from: param sites fixed from the trace.
    params = {k: s["value"] for k, s in model_trace.items() if s["type"] in ("param", "mutable")}
    base_model = substitute(model, data=params) if params else model
    first_available_dim = -_guess_max_plate_nesting(model_trace) - 1 if enumerated else None

    data_plates = [p for p in plates.values() if p.holds_data]
    client_rows = {
        p.name: [np.flatnonzero(p.owner == m) for m in range(num_clients)] for p in data_plates
    }
    client_index = {
        name: np.stack([np.resize(r, plates[name].max_rows) for r in rows])
        for name, rows in client_rows.items()
    }
    client_valid = {
        name: np.arange(plates[name].max_rows)[None, :] < np.array([len(r) for r in rows])[:, None]
        for name, rows in client_rows.items()
    }
    client_data = {
        "client": jnp.arange(num_clients),
        "rows": [jnp.asarray(np.asarray(leaves[i])[client_index[p]]) for i, p in row_leaves.items()],
        "index": {k: jnp.asarray(v) for k, v in client_index.items()},
        "valid": {k: jnp.asarray(v) for k, v in client_valid.items()},
    }
    owners = {name: jnp.asarray(p.owner) for name, p in plates.items() if not p.holds_data}
    placeholders = [jnp.zeros_like(jnp.asarray(leaves[i])[:1]) for i in row_leaves]

    def rebuild_args(row_values):
        new_leaves = list(leaves)
        for i, value in zip(row_leaves, row_values):
            new_leaves[i] = value
        return jax.tree_util.tree_unflatten(treedef, new_leaves)

    def local_latents(z, index_of_plate):
        z = dict(z)
        for site in latent_sites.values():
            if site.plate in index_of_plate:
                z[site.name] = jnp.take(z[site.name], index_of_plate[site.plate], axis=site.unconstrained_axis)
        return z

    def client_potential_fn(z, block):
        """Potential of one client; ``block`` is that client's slice of ``client_data``."""
        args, kwargs = rebuild_args(block["rows"])
        masks = {name: block["valid"][name] for name in block["valid"]}
        masks.update({name: owner == block["client"] for name, owner in owners.items()})
        view = _mask_unowned(base_model, masks=masks, global_mask=False, enumerated=enumerated)
        sizes = {p.name: p.max_rows for p in data_plates}
        z_local = local_latents(z, block["index"])
        with _override_plate_sizes(sizes):
            if enumerated:
                from numpyro.contrib.funsor import config_enumerate, enum
                from numpyro.contrib.funsor import log_density as enum_log_density

                view = enum(config_enumerate(view), first_available_dim)
                log_joint, _ = enum_log_density(_unconstrain(view, z_local), args, kwargs, {})
            else:
                log_joint, _ = _numpyro_log_density(_unconstrain(view, z_local), args, kwargs, {})
        return -log_joint

    def server_view(z, row_values):
        """The model with every federated plate masked out and the data rows replaced."""
        args, kwargs = rebuild_args(row_values)
        first_row = {p.name: jnp.zeros(1, dtype=jnp.int32) for p in data_plates}
        view = _mask_unowned(
            seed(base_model, rng_seed=0),
            masks={name: False for name in plates},
            global_mask=True,
            enumerated=False,
        )
        return _unconstrain(view, local_latents(z, first_row)), args, kwargs

    def server_plates():
        """Context of the server's view: one placeholder row per data plate, and no argument
        validation (the placeholder, zeros, need not be valid for the clients' distributions,
        e.g. a covariance matrix; those sites are masked out and never evaluated)."""
        stack = ExitStack()
        stack.enter_context(_override_plate_sizes({p.name: 1 for p in data_plates}))
        stack.enter_context(validation_enabled(False))
        return stack

    def prior_site_log_probs(z, row_values):
        view, args, kwargs = server_view(z, row_values)
        with server_plates():
            tr = trace(view).get_trace(*args, **kwargs)
        out = {}
        for name, site in tr.items():
            if site["type"] == "sample" and not _in_plates(site, plates):
                log_prob = site["fn"].log_prob(site["value"])
                if site["scale"] is not None:
                    log_prob = site["scale"] * log_prob
                out[name] = jnp.sum(log_prob)
        return out

    def prior_potential_fn(z):
        view, args, kwargs = server_view(z, placeholders)
        with server_plates():
            log_joint, _ = _numpyro_log_density(view, args, kwargs, {})
        return -log_joint

    def server_values(z, row_values):
        view, args, kwargs = server_view(z, row_values)
        with server_plates():
            tr = trace(view).get_trace(*args, **kwargs)
        values = {}
        for name, site in tr.items():
            if name in latent_sites and latent_sites[name].plate not in client_rows:
                values[name] = site["value"]
            elif site["type"] == "deterministic" and not _in_plates(site, plates):
                values[name] = site["value"]
        return values

    def client_row_values(z, block):
        """Constrained values of the row-local latents of one client (padded rows)."""
        args, kwargs = rebuild_args(block["rows"])
        z_local = local_latents(z, block["index"])
        view = _unconstrain(seed(base_model, rng_seed=0), z_local)
        with _override_plate_sizes({p.name: p.max_rows for p in data_plates}):
            tr = trace(view).get_trace(*args, **kwargs)
        return {
            name: tr[name]["value"]
            for name, site in latent_sites.items()
            if site.plate in client_rows
        }

    def row_log_likelihood_fn(z, rows):
        """Log-likelihood of each row of a block of rows: shape ``(num_rows,)``."""
        if len(data_plates) != 1:
            raise ValueError(
                "row_log_likelihood_fn needs exactly one federated data plate, found "
                f"{[p.name for p in data_plates]}"
            )
        if enumerated or any(s.plate is not None for s in latent_sites.values()):
            raise ValueError(
                "row_log_likelihood_fn needs a model whose latent variables are all global: "
                "per-row terms are not defined with client-local or enumerated latents"
            )
        plate = data_plates[0]
        num_rows = jnp.shape(rows[0])[0]
        args, kwargs = rebuild_args(rows)
        view = _unconstrain(seed(base_model, rng_seed=0), z)
        with _override_plate_sizes({plate.name: num_rows}):
            tr = trace(view).get_trace(*args, **kwargs)
        total = jnp.zeros(num_rows)
        for site in tr.values():
            if site["type"] != "sample":
                continue
            frames = [f for f in site["cond_indep_stack"] if f.name == plate.name]
            if not frames:
                continue
            log_prob = site["fn"].log_prob(site["value"])
            if site["scale"] is not None:
                log_prob = site["scale"] * log_prob
            log_prob = jnp.moveaxis(jnp.asarray(log_prob), frames[0].dim, 0)
            total = total + jnp.reshape(log_prob, (num_rows, -1)).sum(axis=1)
        return total

    z0 = _unconstrained_init(model_trace, latent_sites)
    # Deterministic sites computed from client data stay with the clients.
    server_outputs = _data_free_outputs(server_values, z0, placeholders)
    row_local = {name: s for name, s in latent_sites.items() if s.plate in client_rows}
    constrained_axes = {
        name: _plate_axis(model_trace[name], plates[s.plate].dim, constrained=True)
        for name, s in row_local.items()
    }

    def postprocess_fn(z):
        """Constrained values of every latent site and the data-free deterministic sites."""
        values = server_values(z, placeholders)
        values = {k: v for k, v in values.items() if k in server_outputs}
        if row_local:
            per_client = jax.vmap(client_row_values, in_axes=(None, 0))(z, client_data)
            for name, site in row_local.items():
                values[name] = _scatter_rows(
                    per_client[name],
                    client_data["index"][site.plate],
                    plates[site.plate].size,
                    constrained_axes[name],
                )
        return values

    owner_tree = {
        name: _owner_of_coordinates(site, plates, jnp.shape(z0[name]))
        for name, site in latent_sites.items()
    }
    coordinate_owner = np.concatenate(
        [np.ravel(v) for v in jax.tree_util.tree_leaves(owner_tree)] or [np.zeros(0, np.int64)]
    )
    first_data_plate = data_plates[0] if data_plates else next(iter(plates.values()))

    potential = FederatedPotential(
        num_clients=num_clients,
        client_sizes=np.bincount(first_data_plate.owner, minlength=num_clients),
        plates=plates,
        init_params=z0,
        coordinate_owner=coordinate_owner,
        coordinate_owner_tree=owner_tree,
        client_data=client_data,
        enumerated=enumerated,
        prior_potential_fn=prior_potential_fn,
        client_potential_fn=client_potential_fn,
        row_log_likelihood_fn=row_log_likelihood_fn,
        postprocess_fn=postprocess_fn,
        row_arguments=_describe_leaves(treedef, len(leaves), row_leaves),
    )
    if validate:
        _validate_split(
            potential, model, model_args, model_kwargs, model_trace, enumerated,
            prior_site_log_probs, placeholders,
        )
    return potential


