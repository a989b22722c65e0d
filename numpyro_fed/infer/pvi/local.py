"""PVI with client-local latent variables (Ashman et al. 2022, *PVI with local latent
variables*): latent sites inside a :func:`~numpyro_fed.federated_plate` whose rows are owned
by clients (a school's effect, a county's intercept) are each client's own.

The approximation is ``q(theta) prod_m q(z_m)``: ``q(theta)`` over the global latents is
PVI's (``p(theta) [t_0(theta)] prod_m t_m(theta)``, held by the server), and client ``m``
keeps its mean-field Gaussian ``q(z_m)`` over its own coordinates (on the unconstrained
space) as client state, never sent. A client's update maximizes its local free energy

    E_{q(theta) q(z_m)}[log p(y_m, z_m | theta)] + H[q(z_m)] - KL(q(theta) || q / t_m)

jointly over ``q(theta)`` and ``q(z_m)`` (the same optimization as a client without local
latents, :func:`~numpyro_fed.infer.pvi.client.optimize_local`, on the joint vector
``(theta, z_m)``, its "likelihood" the client's whole term of the potential), keeps the new
``q(z_m)`` and sends the change of its factor ``t_m(theta)``: the same message, of the same
size, as a client of a model with global latents only.

With a full-rank ``q(theta)`` (``covariance="full"``) the family is structured instead,
``q(theta) prod_m q(z_m | theta)``: the client keeps its conditional
(:mod:`~numpyro_fed.infer.pvi.conditional`), fits the full-rank joint over ``(theta, z_m)``
and keeps the new conditional; the message is the change of its full-rank factor of
``theta``. The functions below tell the two apart by the shape of the state they hold.

The client's term ``log p(y_m, z_m | theta)`` is the split potential's
(:attr:`~numpyro_fed.FlatPotential.client_potential`), evaluated at the flat vector in which
the global coordinates are ``theta`` and the client's own coordinates (those
:attr:`~numpyro_fed.FederatedPotential.coordinate_owner` gives it) are ``z_m``; it reads no
other client's coordinates. :class:`LocalLatents` holds that layout (numbers of
coordinates, no rows) and builds the clients' functions; :class:`LocalBlockLayout` puts
each client's indices next to its block, where it lives.

Draws of the local sites are the clients' to give: :meth:`LocalLatents.draws` asks each
client for draws of its ``q(z_m)`` (call ``"local_draws"``, counted in the ledger), only
when local sites are asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.base import RunResult, jit_round
from numpyro_fed.infer.pvi import conditional
from numpyro_fed.infer.pvi.client import LocalConfig, optimize_local
from numpyro_fed.infer.pvi.core import DRAW_BATCH, ClientFactor, ClientReply, resolve_factor
from numpyro_fed.infer.pvi.diagnostics import importance_check, warn_importance, warn_mean_field
from numpyro_fed.infer.pvi.gaussian import (
    GaussianNatural,
    as_full,
    is_full,
    loc_scale,
    natural,
    sample,
    sample_log_density,
    tree_sub,
)

__all__ = [
    "MEAN_FIELD_LIMIT",
    "ClientLatentsFace",
    "LocalBlock",
    "LocalBlockLayout",
    "LocalClientState",
    "LocalLatents",
    "local_client_functions",
]

#: ``q(z_m)``'s starting scale on the unconstrained space (around the init strategy's point)
LOCAL_START_SCALE = 1.0
#: the mean-field check of a diagonal q (``"curvature"``, d x d per client; with local latents,
#: (d_g + L) x (d_g + L) on the client) up to this many coordinates
MEAN_FIELD_CHECK_MAX_DIM = 1000
#: the mean-field check with client-local latents averages the curvatures over this many draws
LOCAL_CHECK_DRAWS = 200
#: draws of q in the importance check (PSIS's k-hat needs its tail: about 3 sqrt(S) of them)
IMPORTANCE_DRAWS = 1000
#: what the mean-field check says when q's sds of the global latents are too small
MEAN_FIELD_LIMIT = (
    "with client-local latents q is mean-field by design (q(theta) prod_m q(z_m)): read its sds of "
    "these coordinates as too small"
)
_HALF_LOG_2_PI_E = 0.5 * float(np.log(2 * np.pi * np.e))


class LocalBlock(NamedTuple):
    """A client's block with its own coordinates of the flat latent vector.

    :ivar block: the block as the potential's client functions take it.
    :ivar local_index: ``(L,)`` positions of the client's coordinates (padding: ``d``, out of
        range).
    :ivar local_valid: ``(L,)`` mask of real (non-padding) coordinates.
    """

    block: dict
    local_index: jax.Array
    local_valid: jax.Array


class LocalBlockLayout:
    """``block -> LocalBlock``: the transform of the clients' program, run where the client
    lives. Picklable; it holds coordinate positions (derived from the plates' owners), never
    rows."""

    def __init__(self, local_index, local_valid):
        self.local_index, self.local_valid = np.asarray(local_index), np.asarray(local_valid)

    def __call__(self, block) -> LocalBlock:
        m = int(block["client"])
        return LocalBlock(block, self.local_index[m], self.local_valid[m])

    def __repr__(self):
        return f"LocalBlockLayout(num_clients={self.local_index.shape[0]}, max_local={self.local_index.shape[1]})"


class LocalClientState(NamedTuple):
    """What a PVI client with latents of its own keeps between its visits.

    :ivar ClientFactor own: its factor ``t_m`` of the global latents (as without local
        latents).
    :ivar GaussianNatural local: its ``q(z_m)``, mean-field, ``(L,)`` each (padding
        coordinates: a standard normal).
    :ivar key: the key of its own draws in the loss and the curvature check.
    """

    own: ClientFactor
    local: GaussianNatural
    key: jax.Array


def _concat(a: GaussianNatural, b: GaussianNatural, full: bool = False) -> GaussianNatural:
    """The independent product of ``a`` and ``b`` (``full``: full-rank, ``b`` diagonal)."""
    if not full:
        return GaussianNatural(jnp.concatenate([a.eta1, b.eta1]), jnp.concatenate([a.eta2, b.eta2]))
    a, b = as_full(a), as_full(b)
    return GaussianNatural(jnp.concatenate([a.eta1, b.eta1]), jax.scipy.linalg.block_diag(a.eta2, b.eta2))


def _cut(eta: GaussianNatural, num_global: int):
    head = GaussianNatural(eta.eta1[:num_global], eta.eta2[:num_global])
    return head, GaussianNatural(eta.eta1[num_global:], eta.eta2[num_global:])


def local_client_functions(
    client_potential: Callable, global_index, num_latent: int, config: LocalConfig, *, damping: float = 1.0
) -> tuple[dict, dict]:
    """The functions a PVI client with latents of its own runs on its :class:`LocalBlock`,
    ``(functions, stateful)``, each stateful call ``(block, state, ...) -> (state, reply)`` on
    its :class:`LocalClientState`:

    * ``"update"``: ``(q, thetas, key, applied) -> ClientReply``: as
      :func:`~numpyro_fed.infer.pvi.core.client_functions`' with ``loss_draws=True`` (the
      same messages), the local free energy maximized jointly over ``q(theta)`` and
      ``q(z_m)``; the client keeps the new ``q(z_m)``. Its ``log_lik`` is its term of the
      ELBO at ``thetas`` and its ``q(z_m)`` before the update (as ``"expected_log_lik"``).
    * ``"expected_log_lik"``: ``(thetas (S, d_g)) -> ()``: its term of the ELBO,
      ``E[log p(y_m, z_m | theta)] + H[q(z_m)]`` at ``thetas`` and draws of ``q(z_m)``.
    * ``"curvature"``: ``(thetas) -> (H, S)``, ``(d_g, d_g)`` each: minus the Hessian of
      ``log p(y_m, z_m | theta)`` in ``theta``, and its Schur complement (``z_m`` integrated
      out, Laplace-style), each averaged over draws: what the mean-field check needs.
    * ``"local_draws"``: ``(keys (S, 2), thetas (S, d_g)) -> (S, L)``, draws of ``q(z_m)``
      (structured: of ``q(z_m | theta)`` at the global draws ``thetas``).
    * ``"log_weights"``: ``(keys, thetas) -> (S,)``: at each global draw, the client's term of
      the importance check's log ratios, ``log p(y_m, z_m | theta) - log q(z_m | theta)`` at a
      draw of its ``q(z_m | theta)`` (that of ``"local_draws"`` with the same keys).

    :param client_potential: ``(x, block) -> scalar`` on the flat ``(num_latent,)`` vector.
    :param global_index: ``(d_g,)`` positions of the global coordinates.
    """
    global_index = np.asarray(global_index)
    num_global = int(global_index.size)

    def embed(w, local_index):
        x = jnp.zeros(num_latent, w.dtype).at[global_index].set(w[:num_global])
        return x.at[local_index].set(w[num_global:], mode="drop")

    def log_joint(w, lblock):
        return -client_potential(embed(w, lblock.local_index), lblock.block)

    def draw_local(state, eps, thetas):
        # q(z_m) (mean-field) or q(z_m | theta) at the global draws (structured)
        if is_full(state.local):
            return conditional.draw_conditional(state.local, thetas, eps)
        loc, scale = loc_scale(state.local)
        return loc + scale * eps

    def local_entropy(state, valid):
        if is_full(state.local):
            return conditional.conditional_entropy(state.local, valid)
        return jnp.sum(jnp.where(valid, jnp.log(loc_scale(state.local)[1]) + _HALF_LOG_2_PI_E, 0.0))

    def joint_draws(state, thetas):
        """Draws of ``(theta, z_m)`` at the global draws ``thetas``, and the state with its key
        moved on."""
        key, sub = jax.random.split(state.key)
        eps = jax.random.normal(sub, thetas.shape[:1] + state.local.eta1.shape, thetas.dtype)
        return state._replace(key=key), jnp.concatenate([thetas, draw_local(state, eps, thetas)], axis=-1)

    def expected_log_lik(lblock: LocalBlock, state: LocalClientState, thetas):
        state, draws = joint_draws(state, thetas)
        joint = jax.vmap(lambda w: log_joint(w, lblock))(draws)
        return state, jnp.mean(joint) + local_entropy(state, lblock.local_valid)

    def update(lblock: LocalBlock, state: LocalClientState, q, thetas, key, applied):
        state, log_lik = expected_log_lik(lblock, state, thetas)  # the loss's term, of q(z_m) before the update
        factor = resolve_factor(state.own, applied)
        # padding coordinates: a standard normal "cavity", where they start and stay
        dtype = q.eta1.dtype
        pad = GaussianNatural(jnp.zeros_like(state.local.eta1), jnp.where(lblock.local_valid, 0.0, -0.5).astype(dtype))
        structured = is_full(state.local)
        start = conditional.joint(q, state.local) if structured else _concat(q, state.local)
        cavity = _concat(tree_sub(q, factor), pad, full=structured)
        rows, valid = [jnp.zeros((1,), dtype)], jnp.ones((1,), bool)  # the client's term is one "row"

        def row_log_lik(w, rows):
            return jnp.broadcast_to(log_joint(w, lblock), rows[0].shape[:1])

        new, _, residual = optimize_local(key, row_log_lik, start, cavity, rows, valid, config, with_residual=True)
        if structured:  # the new theta-marginal, and the conditional the client keeps
            new_q, new_local = conditional.split(new, num_global)
            new_local = conditional.mask_padding(new_local, lblock.local_valid)
        else:
            new_q, new_local = _cut(new, num_global)
        delta = tree_sub(new_q, q)
        own = ClientFactor(factor, jax.tree_util.tree_map(lambda d: damping * d, delta))
        reply = ClientReply(delta, jnp.zeros((), q.eta1.dtype), residual, log_lik)
        return LocalClientState(own, new_local, state.key), reply

    def curvature(lblock: LocalBlock, state: LocalClientState, thetas):
        state, draws = joint_draws(state, thetas)
        hessian = jax.hessian(lambda w: -log_joint(w, lblock))
        valid = lblock.local_valid
        both = valid[:, None] & valid[None, :]

        def blocks(totals, w):
            # at each draw: the theta block and its Schur complement (z_m integrated out there),
            # averaged over the draws where the z_m block is positive definite; per draw, so
            # that a dependence whose sign changes between draws (a scale and the effects it
            # scales) does not cancel
            h = hessian(w)
            h_gg, h_gl = h[:num_global, :num_global], h[:num_global, num_global:] * valid
            chol = jnp.linalg.cholesky(jnp.where(both, h[num_global:, num_global:], jnp.diag(~valid * 1.0)))
            schur = h_gg - h_gl @ jax.scipy.linalg.cho_solve((chol, True), h_gl.T)
            ok = jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.isfinite(schur))
            return (totals[0] + h_gg, totals[1] + jnp.where(ok, schur, 0.0), totals[2] + ok), None

        zeros = jnp.zeros((num_global, num_global), draws.dtype)
        (h_gg, schur, count), _ = lax.scan(blocks, (zeros, zeros, jnp.zeros((), draws.dtype)), draws)
        h_gg = h_gg / draws.shape[0]
        return state, (h_gg, jnp.where(count > 0, schur / jnp.maximum(count, 1.0), h_gg))

    def local_eps(state, keys, thetas):
        return jax.vmap(lambda k: jax.random.normal(k, state.local.eta1.shape, thetas.dtype))(keys)

    def local_draws(lblock: LocalBlock, state: LocalClientState, keys, thetas):
        return state, draw_local(state, local_eps(state, keys, thetas), thetas)

    def log_weights(lblock: LocalBlock, state: LocalClientState, keys, thetas):
        # at each global draw, a draw of q(z_m | theta) (that of "local_draws" with the same
        # keys) and log p(y_m, z_m | theta) - log q(z_m | theta); z = mean + C^-T eps, so
        # log q(z | theta) = log N(eps) + sum log C_ii = -H[q(z_m | theta)] + sum (1 - eps^2) / 2
        eps = local_eps(state, keys, thetas)
        draws = jnp.concatenate([thetas, draw_local(state, eps, thetas)], axis=-1)
        joint = lax.map(lambda w: log_joint(w, lblock), draws, batch_size=DRAW_BATCH)
        centred = jnp.sum(jnp.where(lblock.local_valid, 0.5 * (1.0 - jnp.square(eps)), 0.0), axis=-1)
        return state, joint - (centred - local_entropy(state, lblock.local_valid))

    stateful = {
        "update": update,
        "expected_log_lik": expected_log_lik,
        "curvature": curvature,
        "local_draws": local_draws,
        "log_weights": log_weights,
    }
    return {}, stateful


class LocalLatents:
    """The layout of a model's client-local latents in the flat latent vector, as the server
    knows it (from the plates' owners: which client owns which coordinate, no values).

    :param potential: a :class:`~numpyro_fed.FederatedPotential` with client-local latents.

    :ivar global_index: ``(d_g,)`` positions of the global coordinates.
    :ivar local_index: ``(M, L)`` each client's coordinates, padded with ``d``.
    :ivar local_valid: ``(M, L)`` mask of real coordinates.
    :ivar tuple local_sites: the sites with client-local coordinates.
    """

    def __init__(self, potential):
        owner = np.asarray(potential.coordinate_owner)
        self.num_latent = int(owner.size)
        self.num_clients = int(potential.num_clients)
        self.global_index = np.flatnonzero(owner < 0)
        own = [np.flatnonzero(owner == m) for m in range(self.num_clients)]
        width = max(1, max(len(i) for i in own))
        self.local_index = np.full((self.num_clients, width), self.num_latent, np.int32)
        self.local_valid = np.zeros((self.num_clients, width), bool)
        for m, index in enumerate(own):
            self.local_index[m, : len(index)] = index
            self.local_valid[m, : len(index)] = True
        owners = potential.coordinate_owner_tree.items()
        self.local_sites = tuple(name for name, o in owners if (np.asarray(o) >= 0).any())
        self.global_sites = tuple(name for name, o in owners if name not in self.local_sites)
        self._flat = potential.flat()
        self._unravel = potential.unravel
        self._init = np.asarray(potential.ravel(potential.init_params))

    @staticmethod
    def has_local(potential) -> bool:
        """Whether ``potential`` has client-local latent coordinates."""
        return bool((np.asarray(potential.coordinate_owner) >= 0).any())

    def check_settings(self, dp, covariance, sampling="full") -> None:
        """Refuses, naming the design limit, what local latents do not support: the private
        variants and minibatches of rows."""
        sites = list(self.local_sites)
        if dp is not None:
            raise ValueError(
                f"DPPVI(dp={dp!r}) cannot run a model with client-local latent variables (site(s) {sites}): "
                "each client fits its own q(z_m) to all its rows and keeps it between rounds, so every update "
                "it sends depends on every one of its rows through q(z_m), and clipping no longer bounds one "
                "row's influence on what is released: the privacy accounting would not hold. Use dp=None, "
                "or make the sites global (outside the federated plate)"
            )
        if sampling != "full":
            raise ValueError(
                f"sampling={sampling!r} cannot be used with client-local latent variables (site(s) {sites}): "
                "a client's term is optimized whole (its rows share its latents), not in minibatches of rows; "
                "leave sampling and sampling_rate unset"
            )

    @property
    def check_width(self) -> int:
        """The size of a client's matrices in the mean-field check: ``d_g + L``."""
        return self.num_global + int(self.local_index.shape[1])

    @property
    def num_global(self) -> int:
        return int(self.global_index.size)

    def embed(self, thetas, zs=None):
        """Flat ``(..., d)`` vectors from global coordinates ``thetas (..., d_g)`` and the
        clients' draws ``zs (M, ..., L)`` (``None``: zeros)."""
        x = jnp.zeros(thetas.shape[:-1] + (self.num_latent,), thetas.dtype)
        x = x.at[..., self.global_index].set(thetas)
        if zs is None:
            return x
        values = jnp.moveaxis(zs, 0, -2).reshape(thetas.shape[:-1] + (-1,))  # (..., M * L)
        return x.at[..., self.local_index.reshape(-1)].set(values, mode="drop")

    def prior_potential(self, theta):
        """The prior term as a function of the global coordinates (it reads no local one)."""
        return self._flat.prior_potential(self.embed(theta))

    @property
    def init_global(self):
        """The init strategy's point, global coordinates."""
        return jnp.asarray(self._init[self.global_index])

    def layout(self) -> LocalBlockLayout:
        return LocalBlockLayout(self.local_index, self.local_valid)

    def client_functions(self, config: LocalConfig, *, damping: float = 1.0):
        """:func:`local_client_functions` on this model's clients."""
        return local_client_functions(
            self._flat.client_potential, self.global_index, self.num_latent, config, damping=damping
        )

    def initial_clients(self, own: ClientFactor, rng_key, federation, *, structured: bool = False):
        """The clients' initial :class:`LocalClientState` (public values: ``q(z_m)`` at the
        init strategy's point with scale ``LOCAL_START_SCALE``, keys from ``rng_key``), given
        to them through ``federation.init_state``. ``structured``: each keeps ``q(z_m | theta)``
        (:mod:`~numpyro_fed.infer.pvi.conditional`; starting independent of ``theta``), with a
        full-rank ``q(theta)``; otherwise a mean-field ``q(z_m)``."""
        dtype = own.factor.eta1.dtype
        init = np.append(self._init, 0.0)[self.local_index]  # padding: 0
        loc, scale = jnp.asarray(init, dtype), jnp.full(init.shape, LOCAL_START_SCALE, dtype)
        if structured:
            local = jax.vmap(lambda m, s: conditional.initial_conditional(m, s, self.num_global))(loc, scale)
        else:
            local = natural(loc, scale)
        keys = jax.random.split(rng_key, self.num_clients)
        return federation.init_state(LocalClientState(own, local, keys))

    def get_params(self, loc, scale) -> dict:
        """``{"loc", "scale"}`` of ``q(theta)`` by global site."""
        out = {}
        for name, value in (("loc", loc), ("scale", scale)):
            tree = self._unravel(self.embed(value))
            out[name] = {k: v for k, v in tree.items() if k not in self.local_sites}
        return out

    def draws(self, thetas, fetch: Callable | None, sites=None) -> dict:
        """Constrained draws by site from the global draws ``thetas (S, d_g)``: with
        ``fetch`` (``() -> (M, S, L)``, the clients' ``"local_draws"`` at ``thetas``) every site,
        or the ``sites`` asked for; the clients are asked only when a local site is."""
        global_only = sites is not None and set(sites) <= set(self.global_sites)
        zs = None if global_only or fetch is None else fetch()
        values = jax.vmap(self._flat.postprocess)(self.embed(thetas, zs))
        if zs is None:
            values = {k: v for k, v in values.items() if k not in self.local_sites}
        if sites is not None:
            missing = sorted(set(sites) - set(values))
            if missing:
                raise ValueError(f"get_samples: no site(s) {missing}; the model's sites are {sorted(values)}")
            values = {k: v for k, v in values.items() if k in sites}
        return values


class ClientLatentsFace:
    """What :class:`~numpyro_fed.DPPVI`'s face asks of the clients' state after the rounds (a
    mixin): for client-local latents, finds them in the split model, refuses what they do not
    support and fetches draws of the clients' ``q(z_m)``; with or without them, the mean-field
    check (the clients' curvature) and the loss of the final ``q``."""

    #: the model's client-local latents (:class:`LocalLatents`), ``None`` without
    _local: LocalLatents | None = None

    def _find_local(self, potential) -> None:
        self._local = LocalLatents(potential) if LocalLatents.has_local(potential) else None
        if self._local is not None:
            self._local.check_settings(self.dp, self.covariance, self.sampling)

    def _prior_potential(self, potential):
        """The prior term on ``q``'s coordinates (the global ones)."""
        return potential.flat().prior_potential if self._local is None else self._local.prior_potential

    def _read_clients(self, name: str):
        """A compiled ``(args, clients, federation) -> replies`` of the clients' stateful call
        ``name`` on the tuple ``args`` (a read: the state it returns is not kept)."""
        reads = self.__dict__.setdefault("_client_reads", {})
        if name not in reads:
            reads[name] = jit_round(lambda x, clients, federation: federation.map(name, *x, state=clients)[1])
        return reads[name]

    def _map_clients(self, name: str):
        """A compiled ``(x, federation) -> replies`` of the clients' (stateless) function
        ``name`` on ``x``."""
        reads = self.__dict__.setdefault("_client_maps", {})
        if name not in reads:
            reads[name] = jit_round(lambda x, federation: federation.map(name, x))
        return reads[name]

    def _curvatures(self, thetas, clients, federation):
        """``(joint, curvature)``: the sums over the clients of their ``"curvature"`` replies
        (with local latents, :func:`local_client_functions`'; without, ``joint`` is ``None``)."""
        if self._local is not None:
            return jax.tree.map(lambda v: v.sum(0), self._read_clients("curvature")((thetas,), clients, federation))
        return None, jnp.sum(self._map_clients("curvature")(thetas, federation), axis=0)

    def _check_mean_field(self, result):
        """A mean-field ``q`` of a non-private run: the clients return the curvature of their
        log-likelihood at draws of ``q`` (``"curvature"``, a diagnostic counted in the ledger;
        with local latents, integrated out) and the run warns where the correlations it shows
        make ``q``'s sds too small (:func:`~numpyro_fed.infer.pvi.diagnostics.warn_mean_field`)."""
        plan = self._require_plan()
        q = result.state.q
        if (q.eta1.shape[-1] if self._local is None else self._local.check_width) > MEAN_FIELD_CHECK_MAX_DIM:
            return result
        thetas = sample(jax.random.PRNGKey(0), q, self.num_mc_samples if self._local is None else LOCAL_CHECK_DRAWS)
        ledger = None if result.ledger is None else dict(result.ledger)  # the run's ledger counts the check
        joint, curvature = self.through_clients(
            lambda: self._curvatures(thetas, result.state.clients, plan.federation), ledger
        )
        result = result._replace(ledger=ledger)
        prior_hessian = jnp.mean(jax.vmap(jax.hessian(self._prior_potential(self.federated_potential)))(thetas), axis=0)
        diagonal = None if joint is None else np.diag(np.asarray(joint + prior_hessian))
        remedy = {} if joint is None else {"remedy": MEAN_FIELD_LIMIT}
        warn_mean_field(np.asarray(curvature + prior_hessian), diagonal=diagonal, **remedy, stacklevel=3)
        return result

    def _check_importance(self, result):
        """A non-private run's importance check (:func:`~numpyro_fed.infer.pvi.diagnostics.importance_check`
        of :meth:`_importance_ratios`): the Pareto k-hat is ``metrics["pareto_k"]`` (the last
        round's; ``nan`` before it) and the run warns where ``q`` is not the posterior's shape
        (:func:`~numpyro_fed.infer.pvi.diagnostics.warn_importance`)."""
        ledger = None if result.ledger is None else dict(result.ledger)  # the run's ledger counts the check
        thetas, log_ratios = self._importance_ratios(result, ledger)
        check = importance_check(log_ratios, thetas)
        pareto_k = np.full(np.shape(result.metrics["loc"])[0], np.nan)
        pareto_k[-1] = np.nan if check is None else check.pareto_k
        result = result._replace(ledger=ledger, metrics=dict(result.metrics, pareto_k=pareto_k))
        names = self.federated_potential.coordinate_names
        warn_importance(
            check, names if self._local is None else [names[i] for i in self._local.global_index], stacklevel=3
        )
        return result

    def _importance_ratios(self, result, ledger=None, num_draws: int = IMPORTANCE_DRAWS):
        """``(thetas (S, d_g), log_ratios (S,))``: draws of ``q(theta)`` (key ``PRNGKey(1)``)
        and ``log p(theta, z, y) - log q(theta, z)`` at them. The draws go to the clients; each
        returns its term at each (``"log_lik_draws"``, its log-likelihood; with client-local
        latents ``"log_weights"``, ``log p(y_m, z_m | theta) - log q(z_m | theta)`` at a draw of
        its ``q(z_m | theta)`` with keys ``split(PRNGKey(2), S)``; counted in ``ledger``), and
        the server adds the log prior and ``-log q(theta)``."""
        plan = self._require_plan()
        thetas, log_q = sample_log_density(jax.random.PRNGKey(1), result.state.q, num_draws)
        if self._local is None:
            read = self._map_clients("log_lik_draws")
            terms = self.through_clients(lambda: read(thetas, plan.federation), ledger)
        else:
            keys = jax.random.split(jax.random.PRNGKey(2), num_draws)
            read = self._read_clients("log_weights")
            terms = self.through_clients(lambda: read((keys, thetas), result.state.clients, plan.federation), ledger)
        log_prior = -jax.vmap(self._prior_potential(self.federated_potential))(thetas)
        log_ratios = np.asarray(log_prior, np.float64) + np.sum(np.asarray(terms, np.float64), axis=0)
        return np.asarray(thetas), log_ratios - np.asarray(log_q, np.float64)

    def _loss_after_rounds(self, result: RunResult, rng_key) -> RunResult:
        """``metrics["loss"]`` as the loss of ``q`` after each round: the rounds returned the
        loss of ``q`` as each started (:func:`~numpyro_fed.infer.pvi.core.build_step`), so
        round ``t``'s came with round ``t + 1``'s, and the last round's is one more call to the
        clients (:meth:`evaluate` with ``rng_key``, counted in ``result.ledger``; ``None``:
        unknown, ``nan``, a run stopped by a failed client; a run stopped in its first round
        has no loss)."""
        if "loss" not in result.metrics:
            return result
        losses = np.asarray(result.metrics["loss"])
        if rng_key is None:
            last = np.full((), np.nan, losses.dtype)
        else:
            ledger = None if result.ledger is None else dict(result.ledger)
            last = self.through_clients(lambda: self.evaluate(result.state, rng_key=rng_key), ledger)
            result = result._replace(ledger=ledger)
        metrics = dict(result.metrics, loss=np.append(losses[1:], np.asarray(last, losses.dtype)))
        return result._replace(metrics=metrics)

    def _local_samples(self, rng_key, result, flat, sites) -> dict:
        """:meth:`LocalLatents.draws` of the global draws ``flat``, the clients' draws counted
        in ``result.ledger``."""
        keys = jax.random.split(jax.random.fold_in(rng_key, 1), flat.shape[0])
        federation = self._require_plan().federation
        fetch = lambda: self._read_clients("local_draws")((keys, flat), result.state.clients, federation)  # noqa: E731
        return self._local.draws(flat, lambda: self.through_clients(fetch, result.ledger), sites)
