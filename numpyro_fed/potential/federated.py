"""Exact splitting of a NumPyro model's potential energy into a prior term and one term per client.

The potential energy NumPyro samples from (:func:`numpyro.infer.util.potential_energy`) is
``-log p(theta, data)`` on the unconstrained latent space, including the log-Jacobians of the
transforms. :func:`split_potential` writes it as

    potential(z) = prior_potential(z) + sum_m client_potentials(z)[m]

where the prior term holds every site outside federated plates (and their Jacobians), and
client ``m``'s term holds the rows of every federated plate that ``m`` owns: its data rows,
its client-local latent variables and their Jacobians, and its enumerated discrete latents.

Each party's view of the model is in :mod:`~numpyro_fed.potential.views`, the reading of the
model's trace in :mod:`~numpyro_fed.potential.trace` and deployment (rows that never leave the
clients) in :mod:`~numpyro_fed.potential.deployment`. What runs where, and the rules a model
follows for it, is told in the guide's *Federated models* page (``docs/guide/federated-models.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from numpyro.distributions.distribution import validation_enabled
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed.federation.base import ClientProgram
from numpyro_fed.federation.inprocess import InProcess
from numpyro_fed.potential.deployment import TransformedLoader, stand_in_arguments
from numpyro_fed.potential.trace import (
    analyse_trace,
    check_finite_arguments,
    check_observations,
    common_num_clients,
    data_free_outputs,
    describe_leaves,
    find_row_leaves,
    finite_start,
    model_site_dims,
    owner_of_coordinates,
    row_argument_names,
    start_trace,
    unconstrained_init,
    validate_split,
)
from numpyro_fed.potential.views import ModelViews, client_blocks

__all__ = ["FederatedPotential", "FlatPotential", "split_potential"]


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
    :ivar dict site_dims: ``{site: dims}``: the plates (outermost first) and declared event
        dims of every sample and deterministic site that has any, what the ArviZ conversion
        names a site's dims after.
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
        self._jit_client_grads = jax.jit(jax.vmap(jax.value_and_grad(self.client_potential_fn), in_axes=(None, 0)))

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

    def client_program(self, functions, *, transform=None, stateful=None, timeouts=None):
        """A :class:`~numpyro_fed.federation.ClientProgram` running ``functions`` (name ->
        ``f(block, *args)``) on every client: with each client's block (simulation) or with
        a loader that builds the block from the client's own rows on its worker
        (deployment). ``stateful``, ``timeouts``: as the program's.

        :param transform: an optional ``block -> block`` applied to each client's block where
            the client lives (an algorithm's own layout of the rows, e.g. minibatch-ready
            arrays); picklable for engine backends. The functions then receive its output.
        """
        stateful, timeouts = dict(stateful or {}), dict(timeouts or {})
        if self.block_loader is not None:
            loader = self.block_loader if transform is None else TransformedLoader(self.block_loader, transform)
            return ClientProgram(
                functions, loader=loader, num_clients=self.num_clients, stateful=stateful, timeouts=timeouts
            )
        blocks = [self.client_block(m) for m in range(self.num_clients)]
        if transform is not None:
            blocks = [transform(b) for b in blocks]
        return ClientProgram(functions, blocks=blocks, stateful=stateful, timeouts=timeouts)

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

    def init_point(self, init_strategy: Callable, rng_key) -> dict:
        """A start as :attr:`init_params` (unconstrained, dict by site), chosen by another
        NumPyro ``init_strategy`` and ``rng_key``: the model traced again on the server (with
        the deployment's stand-in arguments when the rows are on the clients). What a search
        from several starts uses.

        >>> import jax, numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import init_to_median
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(5.0, 1.0))
        ...     with nf.federated_plate("data", y.shape[0], clients=2):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> fp = nf.split_potential(model, (jax.numpy.zeros(4),))
        >>> z = fp.init_point(init_to_median(num_samples=101), jax.random.PRNGKey(0))
        >>> bool(abs(z["mu"] - 5.0) < 0.3)
        True
        """
        return self.init_point_fn(init_strategy, rng_key)

    @property
    def coordinate_names(self) -> list:
        """``site[i, ...]`` for every coordinate of the flat vector, in :meth:`ravel`'s order
        (what a check names instead of "coordinate 11")."""
        names = []
        for path, owner in jax.tree_util.tree_flatten_with_path(self.coordinate_owner_tree)[0]:
            name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
            shape = np.shape(owner)
            names += [name if not shape else f"{name}[{', '.join(map(str, i))}]" for i in np.ndindex(*shape)]
        return names

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
        Where its point's potential is not finite (with ``validate`` and the rows here), up to
        100 points are drawn, as NumPyro's MCMC does, and the first finite one is kept.
    :param rng_key: key for the initial point (default ``PRNGKey(0)``; the further draws use
        ``fold_in(rng_key, i)``).
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
        models with one federated data plate, global latent variables and client-local ones
        in federated plates of groups (a school's effect, a county's intercept); the rows of
        client ``m`` are the rows its loader returns (the plates' ``clients=`` must give
        ``M`` clients). A loader declares its groups by returning, in place of the argument
        that indexes a plate of groups, a :class:`~numpyro_fed.GroupIndex` (each row's group
        in the client's own numbering, and its number of groups): client ``m`` owns the next
        ``num_groups`` rows of the plate after those of clients ``0..m-1``.
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
            raise ValueError(
                "split_potential takes model_args/model_kwargs (simulation) or loader= (deployment), not both"
            )
        if num_clients is None:
            raise ValueError("split_potential(loader=...) needs num_clients")
        if federation is None:
            federation = InProcess()
        descriptions = federation.describe(loader, int(num_clients))
        model_args, model_kwargs, deployment = stand_in_arguments(descriptions, loader)

    check_finite_arguments(model_args, model_kwargs)

    # In deployment the model is traced with the stand-ins' zeros, which need not be valid
    # arguments of the clients' distributions (a zero measurement sd): no argument validation.
    def stand_ins():
        return validation_enabled(False) if deployment is not None else nullcontext()

    with stand_ins():
        model_trace, start_attempt = start_trace(model, model_args, model_kwargs, rng_key, init_strategy, partition)
        check_observations(model, model_args, model_kwargs, model_trace, partition)
    plates, latent_sites, enumerated = analyse_trace(model_trace, partition)
    if deployment is not None:
        plates = deployment.fix_plates(plates, latent_sites, enumerated)
    num_clients = common_num_clients(plates)

    leaves, treedef = jax.tree_util.tree_flatten((tuple(model_args), model_kwargs))
    row_leaves = find_row_leaves(leaves, plates)
    client_data = client_blocks(leaves, row_leaves, plates, num_clients)
    views = ModelViews(model, model_trace, plates, latent_sites, enumerated, leaves, row_leaves, treedef)

    pooled, tries = None, 1
    if validate and deployment is None:  # deployment: no pooled rows to evaluate a start on
        model_trace, z0, pooled, tries = finite_start(
            model,
            model_args,
            model_kwargs,
            model_trace,
            latent_sites,
            enumerated,
            rng_key,
            init_strategy,
            partition,
            start_attempt,
        )
    else:
        z0 = unconstrained_init(model_trace, latent_sites)
    # Deterministic sites computed from client data stay with the clients.
    server_outputs = data_free_outputs(
        views.server_values, z0, views.placeholders, row_argument_names(model, model_args, model_kwargs, plates)
    )
    views.check_row_local_values_data_free(z0, client_data)
    owner_tree = {name: owner_of_coordinates(site, plates, jnp.shape(z0[name])) for name, site in latent_sites.items()}
    coordinate_owner = np.concatenate(
        [np.ravel(v) for v in jax.tree_util.tree_leaves(owner_tree)] or [np.zeros(0, np.int64)]
    )
    data_plates = [p for p in plates.values() if p.holds_data]
    first_data_plate = data_plates[0] if data_plates else next(iter(plates.values()))

    with stand_ins():
        row_outputs = views.data_free_row_deterministic(z0, client_data)
    postprocess_fn = views.build_postprocess(model_trace, server_outputs, client_data, row_outputs)
    block_loader = None
    if deployment is not None:
        block_loader = deployment.block_loader(treedef, row_leaves, client_data)
        client_data = None  # the stand-in's zeros: the rows are on the workers

    def init_point_fn(strategy, key):
        with stand_ins():
            other, _ = start_trace(model, model_args, model_kwargs, key, strategy, partition)
        return unconstrained_init(other, latent_sites)

    potential = FederatedPotential(
        init_point_fn=init_point_fn,
        block_loader=block_loader,
        num_clients=num_clients,
        client_sizes=np.bincount(first_data_plate.owner, minlength=num_clients),
        plates=plates,
        init_params=z0,
        coordinate_owner=coordinate_owner,
        coordinate_owner_tree=owner_tree,
        client_data=client_data,
        enumerated=enumerated,
        row_local_sites=tuple(sorted(n for n, s in latent_sites.items() if s.plate in views.data_plate_names)),
        prior_potential_fn=views.prior_potential,
        client_potential_fn=views.client_potential,
        row_log_likelihood_fn=views.row_log_likelihood,
        postprocess_fn=postprocess_fn,
        row_arguments=describe_leaves(treedef, len(leaves), row_leaves),
        stand_in_arguments=None if deployment is None else (tuple(model_args), dict(model_kwargs or {})),
        site_dims=model_site_dims(model_trace),
    )
    if validate:
        validate_split(potential, views.prior_site_log_probs, views.placeholders, pooled=pooled, tries=tries)
    return potential
