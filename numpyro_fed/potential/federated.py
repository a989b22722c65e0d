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
        ``None`` in deployment (built with ``loader=``): the rows are on the clients.
    :ivar block_loader: deployment only (else ``None``): the picklable ``m -> block`` that
        builds client ``m``'s block from its own rows on its worker (see
        :meth:`client_program`).
    :ivar bool enumerated: whether discrete latents are marginalised by enumeration.
    :ivar tuple row_local_sites: names of the latent sites that live in a federated data
        plate (one value per data row, held by the row's client).
    :ivar dict row_arguments: the model arguments cut per client (path -> plate name).
    :ivar stand_in_arguments: deployment only (else ``None``): ``(args, kwargs)`` shaped like
        the pooled model arguments with zeros for every row (what the driver traces the model
        with, e.g. for the plate dims of an ArviZ object); never a client's value.
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

    # -- the clients' rows -----------------------------------------------------------------
    @property
    def deployed(self) -> bool:
        """Whether the rows stay on the clients (built with ``loader=``): then there is no
        :attr:`client_data` in this process, and clients are reached through a federation."""
        return self.client_data is None

    def _rows(self):
        if self.client_data is None:
            raise ValueError(
                "this FederatedPotential was built from loaders (deployment): the clients' rows "
                "are on their workers, not in this process; evaluate client terms through a "
                "federation (client_program(...) and Federation.map)"
            )
        return self.client_data

    def client_block(self, m: int):
        """Client ``m``'s block (a copy of its slice of :attr:`client_data`): its rows and
        nothing else, what worker ``m`` receives in simulation."""
        data = self._rows()
        m = int(m)
        if not 0 <= m < self.num_clients:
            raise ValueError(f"client must be in [0, {self.num_clients}), not {m}")
        return jax.tree_util.tree_map(lambda a: jnp.array(a[m], copy=True), data)

    def client_program(self, functions, *, transform=None, stateful=None):
        """A :class:`~numpyro_fed.federation.ClientProgram` running ``functions`` (name ->
        ``f(block, *args)``) on every client: with each client's block (simulation) or with
        a loader that builds the block from the client's own rows on its worker
        (deployment). ``stateful``: as the program's.

        :param transform: an optional ``block -> block`` applied to each client's block where
            the client lives (an algorithm's own layout of the rows, e.g. minibatch-ready
            arrays); picklable for engine backends. The functions then receive its output.
        """
        from numpyro_fed.federation import ClientProgram

        stateful = dict(stateful or {})
        if self.block_loader is not None:
            loader = self.block_loader if transform is None else _TransformedLoader(self.block_loader, transform)
            return ClientProgram(functions, loader=loader, num_clients=self.num_clients, stateful=stateful)
        blocks = [self.client_block(m) for m in range(self.num_clients)]
        if transform is not None:
            blocks = [transform(b) for b in blocks]
        return ClientProgram(functions, blocks=blocks, stateful=stateful)

    # -- values ---------------------------------------------------------------------------
    def prior_potential(self, z) -> jax.Array:
        """The server's term: sites outside federated plates and their log-Jacobians."""
        return self._jit_prior(z)

    def client_potentials(self, z) -> jax.Array:
        """Each client's term, shape ``(M,)``."""
        return self._jit_clients(z, self._rows())

    def potential(self, z) -> jax.Array:
        """``prior_potential(z) + client_potentials(z).sum()``: NumPyro's potential energy."""
        return self._jit_total(z, self._rows())

    # -- gradients ------------------------------------------------------------------------
    def prior_grad(self, z):
        """Gradient of :meth:`prior_potential`, shaped like ``z``."""
        return self._jit_prior_grad(z)[1]

    def client_grads(self, z):
        """Per-client gradients: like ``z`` with a leading axis of size ``M``."""
        return self._jit_client_grads(z, self._rows())[1]

    def grad(self, z):
        """Gradient of :meth:`potential`."""
        return self._jit_total_grad(z, self._rows())[1]

    def value_and_grad(self, z):
        """``(potential(z), grad(z))`` in one pass."""
        return self._jit_total_grad(z, self._rows())

    def client_values_and_grads(self, z):
        """``(client_potentials(z), client_grads(z))`` in one pass."""
        return self._jit_client_grads(z, self._rows())

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
        # The functions capture the pure functions and the unravel only, never ``self`` (which
        # holds the clients' blocks in simulation): they can be shipped to a client as they are.
        unravel = self._ravel_unravel
        prior, client = self.prior_potential_fn, self.client_potential_fn
        row_ll, post = self.row_log_likelihood_fn, self.postprocess_fn
        return FlatPotential(
            prior_potential=lambda x: prior(unravel(x)),
            client_potential=lambda x, block: client(unravel(x), block),
            row_log_likelihood=lambda x, rows: row_ll(unravel(x), rows),
            postprocess=lambda x: post(unravel(x)),
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
    loader: Callable[[int], Any] | None = None,
    num_clients: int | None = None,
    federation=None,
) -> FederatedPotential:
    """Splits ``model``'s potential energy into a prior term and one term per client.

    Two ways to give the clients' rows: ``model_args`` / ``model_kwargs`` (simulation: the
    driver holds the pooled data and cuts it; each client's functions receive its block
    only), or ``loader`` (deployment: the driver never holds rows).

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
        on client data and that the split sums to NumPyro's potential energy (the pooled
        self-check; in deployment only the first check, as there is no pooled data).
    :param loader: deployment: ``loader(m)`` returns client ``m``'s model arguments (a tuple
        of positional arguments, or a dict of keyword arguments), rows first. It runs where
        client ``m`` lives (on its worker with :class:`~numpyro_fed.RayFederation`); the
        server's layout is built from the shapes, dtypes and row counts the clients report,
        and :meth:`FederatedPotential.client_program` gives the clients a loader that builds
        each block from its own rows. Array arguments are rows (the same number per client
        within a client); scalar arguments are settings and must agree across clients. For
        models with global latent variables and one federated data plate; the rows of client
        ``m`` are the rows its loader returns (the plate's ``clients=`` must give ``M``
        clients).
    :param int num_clients: ``M``, with ``loader``.
    :param federation: where the loaders run to describe their rows (default
        :class:`~numpyro_fed.InProcess`: in this process).
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
    deployment = None
    if loader is not None:
        if model_args or model_kwargs:
            raise ValueError("split_potential takes model_args/model_kwargs (simulation) or loader= "
                             "(deployment), not both")
        if num_clients is None:
            raise ValueError("split_potential(loader=...) needs num_clients")
        if federation is None:
            from numpyro_fed.federation import InProcess

            federation = InProcess()
        descriptions = federation.describe(loader, int(num_clients))
        model_args, model_kwargs, deployment = _stand_in_arguments(descriptions, loader)

    _check_finite_arguments(model_args, model_kwargs)
    model_trace = _discovery_trace(model, model_args, model_kwargs, rng_key, init_strategy)
    plates, latent_sites, enumerated = _analyse_trace(model_trace, partition)
    if deployment is not None:
        plates = deployment.fix_plates(plates, latent_sites, enumerated)
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
    # From here on no function sees the pooled rows: every function below rebuilds the model's
    # arguments from these leaves, whose row arguments are one-row placeholders, and a block.
    free_leaves = list(leaves)
    for i, placeholder in zip(row_leaves, placeholders):
        free_leaves[i] = placeholder

    def rebuild_args(row_values):
        new_leaves = list(free_leaves)
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
        sizes = {name: jnp.shape(valid)[0] for name, valid in block["valid"].items()}
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
        with _override_plate_sizes({name: jnp.shape(v)[0] for name, v in block["valid"].items()}):
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

    # The server constrains the row-local latents with zero-filled stand-ins of the clients'
    # rows: it knows the layout (which plate rows each client owns), never the rows.
    row_shapes = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in client_data["rows"]] if client_data else []
    layout = {k: client_data[k] for k in ("client", "index", "valid")} if client_data else None
    if row_local:
        _check_row_local_values_data_free(client_row_values, z0, client_data, row_local)

    def postprocess_fn(z):
        """Constrained values of every latent site and the data-free deterministic sites."""
        values = server_values(z, placeholders)
        values = {k: v for k, v in values.items() if k in server_outputs}
        if row_local:
            stand_in = dict(layout, rows=[jnp.zeros(r.shape, r.dtype) for r in row_shapes])
            per_client = jax.vmap(client_row_values, in_axes=(None, 0))(z, stand_in)
            for name, site in row_local.items():
                values[name] = _scatter_rows(
                    per_client[name],
                    layout["index"][site.plate],
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

    block_loader = None
    if deployment is not None:
        block_loader = deployment.block_loader(treedef, row_leaves, client_data)
        client_data = None  # the stand-in's zeros: the rows are on the workers

    potential = FederatedPotential(
        block_loader=block_loader,
        num_clients=num_clients,
        client_sizes=np.bincount(first_data_plate.owner, minlength=num_clients),
        plates=plates,
        init_params=z0,
        coordinate_owner=coordinate_owner,
        coordinate_owner_tree=owner_tree,
        client_data=client_data,
        enumerated=enumerated,
        row_local_sites=tuple(sorted(row_local)),
        prior_potential_fn=prior_potential_fn,
        client_potential_fn=client_potential_fn,
        row_log_likelihood_fn=row_log_likelihood_fn,
        postprocess_fn=postprocess_fn,
        row_arguments=_describe_leaves(treedef, len(leaves), row_leaves),
        stand_in_arguments=None if deployment is None else (tuple(model_args), dict(model_kwargs or {})),
    )
    if validate:
        _validate_split(
            potential, model, model_args, model_kwargs, model_trace, enumerated,
            prior_site_log_probs, placeholders, pooled=deployment is None,
        )
    return potential


def _check_row_local_values_data_free(client_row_values, z0, client_data, row_local):
    """The server constrains row-local latents with zero stand-ins of the rows: refuse models
    where their constrained values depend on the data (e.g. a support bounded by a data
    column), checked at the initial point against the real rows."""
    stand_in = dict(client_data, rows=[jnp.zeros_like(r) for r in client_data["rows"]])
    real = jax.vmap(client_row_values, in_axes=(None, 0))(z0, client_data)
    fake = jax.vmap(client_row_values, in_axes=(None, 0))(z0, stand_in)
    dependent = sorted(name for name in row_local
                       if not np.allclose(np.asarray(real[name]), np.asarray(fake[name]), equal_nan=True))
    if dependent:
        raise ValueError(
            f"the constrained values of the client-local latent site(s) {dependent} depend on "
            "client data (their support is computed from the rows): the server could not "
            "report them without the clients' rows"
        )


# -- deployment: the rows stay on the clients -------------------------------------------------


def _as_arguments(loaded, client):
    """A loader's output as the model's ``(args, kwargs)``."""
    if isinstance(loaded, Mapping):
        return (), dict(loaded)
    if isinstance(loaded, (tuple, list)):
        return tuple(loaded), {}
    raise TypeError(f"client {client}: the loader must return a tuple of positional model "
                    f"arguments or a dict of keyword arguments, not {type(loaded).__name__}")


def _stand_in_arguments(descriptions, loader):
    """Zero-filled stand-ins of the pooled arguments, built from what the clients reported
    (shapes, dtypes, row counts, scalar settings), and the deployment's bookkeeping."""
    described = [_as_arguments(d, m) for m, d in enumerate(descriptions)]
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    flat = [jax.tree_util.tree_flatten(d, is_leaf=is_leaf) for d in described]
    treedef = flat[0][1]
    counts = []
    for m, (leaves, tdef) in enumerate(flat):
        if tdef != treedef:
            raise ValueError(f"client {m}'s loader returns arguments of structure {tdef}, client 0's {treedef}")
        rows = {leaf.shape[0] for leaf in leaves if is_leaf(leaf)}
        if len(rows) != 1:
            raise ValueError(
                f"client {m}'s array arguments have different numbers of rows {sorted(rows)}: in "
                "deployment every array argument holds the client's rows, rows first")
        counts.append(rows.pop())
    stand_in = []
    for i, leaf in enumerate(flat[0][0]):
        others = [f[0][i] for f in flat]
        if is_leaf(leaf):
            for m, other in enumerate(others):
                if other.shape[1:] != leaf.shape[1:] or other.dtype != leaf.dtype:
                    raise ValueError(
                        f"model argument {i}: client {m} has rows of shape {other.shape[1:]} and dtype "
                        f"{other.dtype}, client 0 {leaf.shape[1:]} and {leaf.dtype}")
            stand_in.append(np.zeros((sum(counts),) + tuple(leaf.shape[1:]), leaf.dtype))
        else:
            for m, other in enumerate(others):
                if not np.array_equal(np.asarray(other), np.asarray(leaf)):
                    raise ValueError(f"model argument {i} (a setting, not rows) differs between "
                                     f"client 0 ({leaf!r}) and client {m} ({other!r})")
            stand_in.append(leaf)
    args, kwargs = jax.tree_util.tree_unflatten(treedef, stand_in)
    return args, kwargs, _Deployment(loader, np.asarray(counts, dtype=np.int64))


class _Deployment:
    """What split_potential needs to know in deployment mode: the loader and the row counts."""

    def __init__(self, loader, counts):
        self.loader = loader
        self.counts = counts

    def fix_plates(self, plates, latent_sites, enumerated):
        """The data plate's rows are owned as the loaders returned them: client m the m-th
        contiguous block of ``counts[m]`` rows of the stand-in."""
        data = [p for p in plates.values() if p.holds_data]
        local = sorted(name for name, site in latent_sites.items() if site.plate is not None)
        if len(plates) != 1 or len(data) != 1 or local or enumerated:
            raise ValueError(
                "split_potential(loader=...) (deployment) supports models with global latent "
                "variables and one federated data plate; this model has federated plates "
                f"{sorted(plates)}" + (f", client-local latent sites {local}" if local else "")
                + (", enumerated discrete latents" if enumerated else "")
                + ". Use model_args (simulation) for it."
            )
        plate = data[0]
        declared = int(plate.owner.max()) + 1
        if declared != len(self.counts):
            raise ValueError(
                f"federated plate '{plate.name}' declares {declared} clients, but there are "
                f"{len(self.counts)} loaders (num_clients)")
        if (self.counts == 0).any():
            raise ValueError(f"client(s) {np.flatnonzero(self.counts == 0).tolist()} loaded no rows")
        from dataclasses import replace

        owner = np.repeat(np.arange(len(self.counts)), self.counts)
        return {plate.name: replace(plate, owner=owner, max_rows=int(self.counts.max()))}

    def block_loader(self, treedef, row_leaves, stand_in_data):
        plate = next(iter(stand_in_data["index"]))
        return DeployedBlockLoader(
            self.loader, treedef, tuple(row_leaves), self.counts, plate,
            index_dtype=np.dtype(stand_in_data["index"][plate].dtype).str,
            client_dtype=np.dtype(stand_in_data["client"].dtype).str,
        )


class _TransformedLoader:
    """``m -> transform(loader(m))``: an algorithm's layout of a block, built on the worker."""

    def __init__(self, loader, transform):
        self.loader = loader
        self.transform = transform

    def __call__(self, m):
        return self.transform(self.loader(m))


class DeployedBlockLoader:
    """Runs on client ``m``'s worker: ``loader(m)``, checked against what the client reported,
    cut into the block layout of :attr:`FederatedPotential.client_data` (rows padded to the
    largest client's count by repeating the client's own rows, and masked). Picklable; it
    holds the user's loader, the layout and the row counts, never rows."""

    def __init__(self, loader, treedef, row_leaves, counts, plate, *, index_dtype, client_dtype):
        self.loader = loader
        self.treedef = treedef
        self.row_leaves = tuple(row_leaves)
        self.counts = np.asarray(counts)
        self.plate = plate
        self.index_dtype = index_dtype
        self.client_dtype = client_dtype

    def __call__(self, m):
        m = int(m)
        args = _as_arguments(self.loader(m), m)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if treedef != self.treedef:
            raise ValueError(f"client {m}: the loader's arguments have structure {treedef}, "
                             f"expected {self.treedef}")
        n = int(self.counts[m])
        for i in self.row_leaves:
            if np.shape(leaves[i])[0] != n:
                raise ValueError(f"client {m}: model argument {i} has {np.shape(leaves[i])[0]} rows; "
                                 f"the client reported {n}")
        max_rows = int(self.counts.max())
        own = np.resize(np.arange(n), max_rows)
        offset = int(self.counts[:m].sum())
        return {
            "client": np.asarray(m, dtype=self.client_dtype),
            "rows": [np.asarray(leaves[i])[own] for i in self.row_leaves],
            "index": {self.plate: (offset + own).astype(self.index_dtype)},
            "valid": {self.plate: np.arange(max_rows) < n},
        }

    def __repr__(self):
        return f"DeployedBlockLoader(num_clients={len(self.counts)}, rows={self.counts.tolist()})"
