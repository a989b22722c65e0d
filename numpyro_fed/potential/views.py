"""Each party's view of a model, the functions :func:`~numpyro_fed.split_potential` builds the
split from: the model with the pooled rows replaced by a one-row placeholder
(:class:`ModelViews`), run by the server (its prior term, the constrained values it reports)
or by a client on its own block (its potential, its rows' log-likelihoods, its row-local
latents), and the stacked, padded blocks of the clients (:func:`client_blocks`)."""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.distributions.distribution import validation_enabled
from numpyro.handlers import seed, substitute, trace

# Private NumPyro helper, for want of a public one: _guess_max_plate_nesting is what NumPyro's
# MCMC uses to size enumeration; the split must enumerate as NumPyro's potential does.
from numpyro.infer.util import _guess_max_plate_nesting
from numpyro.infer.util import log_density as numpyro_log_density

from numpyro_fed.plate import override_plate_sizes
from numpyro_fed.potential.handlers import mask_unowned, unconstrain
from numpyro_fed.potential.trace import in_plates, plate_axis, scatter_rows, tainted_outputs

__all__ = ["ModelViews", "client_blocks"]


def client_blocks(leaves, row_leaves: dict, plates: dict, num_clients: int) -> dict:
    """Every client's block, stacked on a leading client axis: ``client`` (its index),
    ``rows`` (the row arguments ``leaves[i]``, ``i`` in ``row_leaves``, cut to the client's
    rows of their plate and padded to the largest client's count by repeating one of its own
    rows), ``index`` (the plate rows each block row is) and ``valid`` (the padding mask), the
    last two by data plate."""
    data_plates = [p for p in plates.values() if p.holds_data]
    client_rows = {p.name: [np.flatnonzero(p.owner == m) for m in range(num_clients)] for p in data_plates}
    client_index = {
        name: np.stack([np.resize(r, plates[name].max_rows) for r in rows]) for name, rows in client_rows.items()
    }
    client_valid = {
        name: np.arange(plates[name].max_rows)[None, :] < np.array([len(r) for r in rows])[:, None]
        for name, rows in client_rows.items()
    }
    return {
        "client": jnp.arange(num_clients),
        "rows": [jnp.asarray(np.asarray(leaves[i])[client_index[p]]) for i, p in row_leaves.items()],
        "index": {k: jnp.asarray(v) for k, v in client_index.items()},
        "valid": {k: jnp.asarray(v) for k, v in client_valid.items()},
    }


class ModelViews:
    """A model's views, pure functions of the unconstrained latent values ``z`` (a dict by
    site) that never see the pooled rows: the model's arguments are rebuilt from the
    argument leaves with every row argument replaced by a one-row placeholder, and a block.

    :param model: the user's model.
    :param model_trace: its discovery trace (param sites are fixed from it, as NumPyro does).
    :param dict plates: :class:`~numpyro_fed.potential.trace.PlateInfo` by name.
    :param dict latent_sites: :class:`~numpyro_fed.potential.trace.LatentSite` by name.
    :param bool enumerated: whether discrete latents are enumerated.
    :param list leaves: the flattened ``(args, kwargs)``; only their non-row leaves are kept.
    :param dict row_leaves: ``{leaf index: data plate}`` of the row arguments.
    :param treedef: the arguments' tree structure.
    """

    def __init__(self, model, model_trace, plates, latent_sites, enumerated, leaves, row_leaves, treedef):
        # The model NumPyro would build its potential from: param sites fixed from the trace.
        params = {k: s["value"] for k, s in model_trace.items() if s["type"] in ("param", "mutable")}
        self.base_model = substitute(model, data=params) if params else model
        self.first_available_dim = -_guess_max_plate_nesting(model_trace) - 1 if enumerated else None
        self.plates, self.latent_sites, self.enumerated = plates, latent_sites, enumerated
        self.data_plates = [p for p in plates.values() if p.holds_data]
        self.data_plate_names = {p.name for p in self.data_plates}
        self.owners = {name: jnp.asarray(p.owner) for name, p in plates.items() if not p.holds_data}
        #: deterministic sites inside one data plate: ``{name: (plate, axis)}`` (a client
        #: computes its rows of them; the server reports those that do not use the rows)
        self.row_deterministic = {}
        for name, site in model_trace.items():
            frames = [f for f in site.get("cond_indep_stack", ()) if f.name in self.data_plate_names]
            if site["type"] != "deterministic" or len(frames) != 1:
                continue
            shape, frame = jnp.shape(site["value"]), frames[0]
            if len(shape) >= -frame.dim and shape[frame.dim] == plates[frame.name].size:
                self.row_deterministic[name] = (frame.name, frame.dim)
        self.row_leaves, self.treedef = dict(row_leaves), treedef
        self.placeholders = [jnp.zeros_like(jnp.asarray(leaves[i])[:1]) for i in row_leaves]
        # From here on no function sees the pooled rows: every function rebuilds the model's
        # arguments from these leaves, whose row arguments are one-row placeholders, and a block.
        self.free_leaves = list(leaves)
        for i, placeholder in zip(row_leaves, self.placeholders):
            self.free_leaves[i] = placeholder

    def rebuild_args(self, row_values):
        """The model's ``(args, kwargs)`` with ``row_values`` as its row arguments."""
        new_leaves = list(self.free_leaves)
        for i, value in zip(self.row_leaves, row_values):
            new_leaves[i] = value
        return jax.tree_util.tree_unflatten(self.treedef, new_leaves)

    def local_latents(self, z, index_of_plate):
        """``z`` with each row-local latent cut to the rows ``index_of_plate[plate]``."""
        z = dict(z)
        for site in self.latent_sites.values():
            if site.plate in index_of_plate:
                z[site.name] = jnp.take(z[site.name], index_of_plate[site.plate], axis=site.unconstrained_axis)
        return z

    # -- a client's view ---------------------------------------------------------------------
    def client_potential(self, z, block):
        """Potential of one client; ``block`` is that client's slice of ``client_data``."""
        args, kwargs = self.rebuild_args(block["rows"])
        masks = {name: block["valid"][name] for name in block["valid"]}
        masks.update({name: owner == block["client"] for name, owner in self.owners.items()})
        view = mask_unowned(self.base_model, masks=masks, global_mask=False, enumerated=self.enumerated)
        sizes = {name: jnp.shape(valid)[0] for name, valid in block["valid"].items()}
        z_local = self.local_latents(z, block["index"])
        with override_plate_sizes(sizes):
            if self.enumerated:
                from numpyro.contrib.funsor import config_enumerate, enum
                from numpyro.contrib.funsor import log_density as enum_log_density

                view = enum(config_enumerate(view), self.first_available_dim)
                log_joint, _ = enum_log_density(unconstrain(view, z_local), args, kwargs, {})
            else:
                log_joint, _ = numpyro_log_density(unconstrain(view, z_local), args, kwargs, {})
        return -log_joint

    def client_row_values(self, z, block, deterministic=()):
        """Constrained values of the row-local latents of one client (padded rows), and of
        the deterministic sites named in ``deterministic`` (of :attr:`row_deterministic`)."""
        args, kwargs = self.rebuild_args(block["rows"])
        z_local = self.local_latents(z, block["index"])
        view = unconstrain(seed(self.base_model, rng_seed=0), z_local)
        with override_plate_sizes({name: jnp.shape(v)[0] for name, v in block["valid"].items()}):
            tr = trace(view).get_trace(*args, **kwargs)
        names = [name for name, site in self.latent_sites.items() if site.plate in self.data_plate_names]
        return {name: tr[name]["value"] for name in names + list(deterministic)}

    def data_free_row_deterministic(self, z0, client_data) -> set:
        """The :attr:`row_deterministic` sites whose values do not use the clients' rows (by
        data flow, on the first block's shapes): the server can report them as it reports
        the row-local latents."""
        if not self.row_deterministic or client_data is None:
            return set()
        block = jax.tree_util.tree_map(lambda a: a[0], client_data)
        names = tuple(self.row_deterministic)

        def values(z, rows):
            out = self.client_row_values(z, dict(block, rows=rows), deterministic=names)
            return {name: out[name] for name in names}

        flags = tainted_outputs(values, (z0, block["rows"]), 1)
        return {name for name, tainted in flags.items() if not tainted}

    def row_log_likelihood(self, z, rows):
        """Log-likelihood of each row of a block of rows: shape ``(num_rows,)``."""
        if len(self.data_plates) != 1:
            raise ValueError(
                "row_log_likelihood_fn needs exactly one federated data plate, found "
                f"{[p.name for p in self.data_plates]}"
            )
        if self.enumerated or any(s.plate is not None for s in self.latent_sites.values()):
            raise ValueError(
                "row_log_likelihood_fn needs a model whose latent variables are all global: "
                "per-row terms are not defined with client-local or enumerated latents"
            )
        plate = self.data_plates[0]
        num_rows = jnp.shape(rows[0])[0]
        args, kwargs = self.rebuild_args(rows)
        view = unconstrain(seed(self.base_model, rng_seed=0), z)
        with override_plate_sizes({plate.name: num_rows}):
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

    # -- the server's view -------------------------------------------------------------------
    def server_view(self, z, row_values):
        """The model with every federated plate masked out and the data rows replaced."""
        args, kwargs = self.rebuild_args(row_values)
        first_row = {p.name: jnp.zeros(1, dtype=jnp.int32) for p in self.data_plates}
        view = mask_unowned(
            seed(self.base_model, rng_seed=0),
            masks={name: False for name in self.plates},
            global_mask=True,
            enumerated=False,
        )
        return unconstrain(view, self.local_latents(z, first_row)), args, kwargs

    def server_plates(self):
        """Context of the server's view: one placeholder row per data plate, and no argument
        validation (the placeholder, zeros, need not be valid for the clients' distributions,
        e.g. a covariance matrix; those sites are masked out and never evaluated)."""
        stack = ExitStack()
        stack.enter_context(override_plate_sizes({p.name: 1 for p in self.data_plates}))
        stack.enter_context(validation_enabled(False))
        return stack

    def prior_site_log_probs(self, z, row_values):
        """The log-density of every site outside federated plates, by site (what the prior
        term is made of; checked not to depend on ``row_values``)."""
        view, args, kwargs = self.server_view(z, row_values)
        with self.server_plates():
            tr = trace(view).get_trace(*args, **kwargs)
        out = {}
        for name, site in tr.items():
            if site["type"] == "sample" and not in_plates(site, self.plates):
                log_prob = site["fn"].log_prob(site["value"])
                if site["scale"] is not None:
                    log_prob = site["scale"] * log_prob
                out[name] = jnp.sum(log_prob)
        return out

    def prior_potential(self, z):
        """The server's term: sites outside federated plates and their log-Jacobians."""
        view, args, kwargs = self.server_view(z, self.placeholders)
        with self.server_plates():
            log_joint, _ = numpyro_log_density(view, args, kwargs, {})
        return -log_joint

    def server_values(self, z, row_values):
        """Values of the global latent sites and of the deterministic sites outside federated
        data plates, by site: a deterministic site in a federated plate of groups (eight
        schools' ``theta = mu + tau * theta_tilde``) has its whole plate here, as the groups'
        latents do (those inside a data plate are :attr:`row_deterministic`)."""
        view, args, kwargs = self.server_view(z, row_values)
        with self.server_plates():
            tr = trace(view).get_trace(*args, **kwargs)
        values = {}
        for name, site in tr.items():
            if name in self.latent_sites and self.latent_sites[name].plate not in self.data_plate_names:
                values[name] = site["value"]
            elif site["type"] == "deterministic" and not in_plates(site, self.data_plate_names):
                values[name] = site["value"]
        return values

    def build_postprocess(self, model_trace, server_outputs, client_data, row_outputs=()):
        """``z -> dict`` of constrained values of every latent site and of the deterministic
        sites in ``server_outputs`` (those that do not depend on client data) and
        ``row_outputs`` (deterministic sites inside a data plate that do not depend on client
        data, e.g. ``theta = mu + tau * theta_tilde`` of a non-centred group effect). The
        server constrains the row-local latents with zero-filled stand-ins of the clients'
        rows: it knows the layout of ``client_data`` (which plate rows each client owns),
        never the rows."""
        row_outputs = tuple(sorted(row_outputs))
        plates = self.plates
        row_local = {name: s for name, s in self.latent_sites.items() if s.plate in self.data_plate_names}
        constrained_axes = {
            name: plate_axis(model_trace[name], plates[s.plate].dim, constrained=True) for name, s in row_local.items()
        }
        row_shapes = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in client_data["rows"]] if client_data else []
        layout = {k: client_data[k] for k in ("client", "index", "valid")} if client_data else None

        def postprocess_fn(z):
            """Constrained values of every latent site and the data-free deterministic sites."""
            values = self.server_values(z, self.placeholders)
            values = {k: v for k, v in values.items() if k in server_outputs}
            if row_local or row_outputs:
                stand_in = dict(layout, rows=[jnp.zeros(r.shape, r.dtype) for r in row_shapes])
                per_client = jax.vmap(partial(self.client_row_values, deterministic=row_outputs), in_axes=(None, 0))(
                    z, stand_in
                )
                for name, site in row_local.items():
                    values[name] = scatter_rows(
                        per_client[name],
                        layout["index"][site.plate],
                        plates[site.plate].size,
                        constrained_axes[name],
                    )
                for name in row_outputs:
                    plate, axis = self.row_deterministic[name]
                    # vmap put the client axis first: the plate's axis counts from the right
                    values[name] = scatter_rows(per_client[name], layout["index"][plate], plates[plate].size, axis)
            return values

        return postprocess_fn

    def check_row_local_values_data_free(self, z0, client_data):
        """The server constrains row-local latents with zero stand-ins of the rows: refuse
        models where their constrained values depend on the data (e.g. a support bounded by a
        data column), checked at the initial point against the real rows."""
        row_local = [name for name, s in self.latent_sites.items() if s.plate in self.data_plate_names]
        if not row_local:
            return
        stand_in = dict(client_data, rows=[jnp.zeros_like(r) for r in client_data["rows"]])
        real = jax.vmap(self.client_row_values, in_axes=(None, 0))(z0, client_data)
        fake = jax.vmap(self.client_row_values, in_axes=(None, 0))(z0, stand_in)
        dependent = sorted(
            name
            for name in row_local
            if not np.allclose(np.asarray(real[name]), np.asarray(fake[name]), equal_nan=True)
        )
        if dependent:
            raise ValueError(
                f"the constrained values of the client-local latent site(s) {dependent} depend on "
                "client data (their support is computed from the rows): the server could not "
                "report them without the clients' rows"
            )
