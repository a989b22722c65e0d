"""The prior's place in PVI's ``q``: an exact Gaussian part and, where the prior is not a
Gaussian with independent coordinates on the unconstrained space, a factor of its own.

``q = p_G x t_0 x prod_m t_m``: ``p_G`` (:attr:`PriorSplit.base`) holds every coordinate on
which the prior's potential is a separable quadratic (a ``Normal`` prior, a ``LogNormal``
scale, whose log-Jacobian makes it Gaussian on the log scale) or a separable linear function
(a flat prior, ``ImproperUniform``: zero precision), exactly; ``t_0`` (the *prior factor*) is
a Gaussian factor the server refines with the same local update a client uses, its
"likelihood" the rest of the prior's log-density on the unconstrained space, log-Jacobians
included (:func:`prior_remainder`): a ``HalfCauchy`` scale, a hierarchical ``Normal(0,
sigma)``, a ``Dirichlet``. It touches no rows.

A proper starting ``q`` (:attr:`PriorSplit.start`) is ``p_G`` where ``p_G`` is proper, and
elsewhere a unit-scale Gaussian centred on the model's initial point (the ``init_strategy``'s,
as NumPyro's MCMC would start there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.infer.pvi import core
from numpyro_fed.infer.pvi.client import LocalConfig, optimize_local
from numpyro_fed.infer.pvi.gaussian import (
    GaussianNatural,
    as_full,
    is_full,
    loc_cov_factor,
    natural,
    proper,
    tree_add,
    tree_sub,
)

__all__ = ["PriorSplit", "build_prior_update", "initial_state", "marginal", "prior_remainder", "split_prior"]

#: the starting ``q``'s scale, on the unconstrained space, where the prior gives none
START_SCALE = 1.0


class PriorSplit(NamedTuple):
    """How a model's prior enters PVI's ``q`` (see the module's docstring).

    :ivar GaussianNatural base: ``p_G``, ``(d,)`` each: zero on refined coordinates.
    :ivar numpy.ndarray refined: ``(d,)`` bool, the coordinates of the prior factor ``t_0``.
    :ivar GaussianNatural start: a proper starting ``q``.
    :ivar bool exact: the prior is ``p_G``, a proper Gaussian: no prior factor, ``q``
        starts at the prior (the conjugate path).
    """

    base: GaussianNatural
    refined: np.ndarray
    start: GaussianNatural
    exact: bool


def split_prior(prior_potential: Callable, init_loc, *, rtol: float | None = None) -> PriorSplit:
    """Reads the prior off its potential (``z -> -log p(z)`` on the flat unconstrained
    space, log-Jacobians included) from gradients: coordinate ``i`` is in ``p_G`` when
    ``grad_i(z) = g0_i + h_i z_i`` with ``h_i >= 0`` at random points (as
    :func:`~numpyro_fed.infer.pvi.gaussian.gaussian_prior` checks for all coordinates).

    >>> split = split_prior(lambda z: 0.5 * z[0] ** 2 + jnp.logaddexp(0.0, 2 * z[1]) - z[1], jnp.zeros(3))
    >>> split.refined.tolist(), split.exact          # z[1]: a HalfCauchy's log-scale; z[2]: flat
    ([False, True, False], False)
    >>> [float(v) for v in split.base.eta2]
    [-0.5, 0.0, 0.0]
    """
    init_loc = jnp.asarray(init_loc)
    d, dtype = init_loc.shape[0], init_loc.dtype
    if rtol is None:
        rtol = 1e-6 if dtype == jnp.float64 else 1e-3
    grad = jax.jit(jax.grad(prior_potential))
    g0 = grad(jnp.zeros(d, dtype))
    h = grad(jnp.ones(d, dtype)) - g0
    probes = jax.random.normal(jax.random.PRNGKey(0), (2, d), dtype) * 2.0
    atol = rtol * (1.0 + jnp.max(jnp.abs(g0)))
    separable = np.ones(d, bool)
    for z in probes:
        separable &= np.asarray(jnp.abs(grad(z) - (g0 + h * z)) <= atol + rtol * jnp.abs(g0 + h * z))
    h = np.asarray(h)
    if separable.all() and (h > 0).all():
        prior = GaussianNatural(-g0, -0.5 * jnp.asarray(h))
        return PriorSplit(prior, ~separable, prior, True)
    flat = separable & (np.abs(h) <= float(atol))
    refined = ~separable | (h < 0) & ~flat
    keep = ~refined
    precision = np.where(keep & ~flat, h, 0.0)
    base = GaussianNatural(jnp.where(keep, -g0, 0.0).astype(dtype), jnp.asarray(-0.5 * precision + 0.0, dtype))
    proper = jnp.asarray(precision > 0)
    start_loc = jnp.where(proper, -g0 / jnp.where(proper, jnp.asarray(h, dtype), 1.0), init_loc)
    start_scale = jnp.where(proper, 1.0 / jnp.sqrt(jnp.where(proper, jnp.asarray(h, dtype), 1.0)), START_SCALE)
    return PriorSplit(base, refined, natural(start_loc, start_scale.astype(dtype)), False)


def prior_remainder(prior_potential: Callable, base: GaussianNatural) -> Callable:
    """``z -> log p(z) - log p_G(z)`` (up to a constant): the prior factor's "likelihood",
    constant in ``p_G``'s coordinates."""

    def remainder(z):
        return -prior_potential(z) - jnp.sum(base.eta1 * z + base.eta2 * jnp.square(z))

    return remainder


def marginal(eta: GaussianNatural, index) -> GaussianNatural:
    """The marginal of the proper Gaussian ``eta`` over the coordinates ``index`` (natural
    parameters, full-rank where ``eta`` is).

    >>> q = GaussianNatural(jnp.array([1.0, 0.0]), -0.5 * jnp.array([[2.0, 1.0], [1.0, 2.0]]))
    >>> m = marginal(q, np.array([1]))   # variance 2/3, mean -1/3
    >>> [round(float(v), 6) for v in m.eta1], [[round(float(v), 6) for v in r] for r in m.eta2]
    ([-0.5], [[-0.75]])
    """
    if not is_full(eta):  # independent coordinates: the marginal is their block
        return _block(eta, index)
    loc, chol = loc_cov_factor(eta)
    cov = chol[index] @ chol[index].T
    precision = jnp.linalg.inv(0.5 * (cov + cov.T))
    precision = 0.5 * (precision + precision.T)
    return GaussianNatural(precision @ loc[index], -0.5 * precision)


def _block(eta: GaussianNatural, index) -> GaussianNatural:
    """``eta``'s natural parameters on the coordinates ``index`` (a factor's, not a marginal)."""
    if not is_full(eta):
        return GaussianNatural(eta.eta1[index], eta.eta2[index])
    return GaussianNatural(eta.eta1[index], eta.eta2[np.ix_(index, index)])


def _scatter(eta2, index, like: GaussianNatural):
    """``eta2`` on the coordinates ``index`` placed in zeros of ``like.eta2``'s shape."""
    if is_full(like):
        return jnp.zeros_like(like.eta2).at[np.ix_(index, index)].set(eta2)
    return jnp.zeros_like(like.eta2).at[index].set(eta2)


def build_prior_update(remainder: Callable, refined, config: LocalConfig, *, damping: float = 1.0) -> Callable:
    """A pure ``prior_update(state, key) -> (state, residual)``: the server refines the
    prior factor ``t_0`` with a client's local update (:func:`~numpyro_fed.infer.pvi.client.optimize_local`,
    plain optimization, ``config``'s steps and draws), its "likelihood" ``remainder`` (the
    prior's log-density that ``state.prior`` does not hold, see
    :func:`~numpyro_fed.infer.pvi.prior.prior_remainder`), which depends on the ``refined``
    coordinates ``R`` only (``(d,)`` bool). No rows enter: it costs no privacy budget.

    The fit is over ``R`` alone: ``t_0`` is a function of ``z_R``, so ``q = cavity x t_0``
    has the cavity's conditional of the other coordinates given ``z_R``, and ``q``'s
    marginal over ``R`` is the cavity's marginal times ``t_0`` (the cavity's marginal is
    therefore ``q_R / t_0``). The local update of ``q_R`` against it gives the new ``t_0``
    exactly as a fit over all coordinates would in exact arithmetic, without that fit's
    Monte Carlo noise in the other coordinates: masking a full fit's change to ``R`` kept its
    noisy covariances with ``R`` through ``eta1 = P mu`` (a Student-t's ``log nu`` under a
    ``Gamma`` prior, next to an intercept at 19 on raw covariates, moved ``q`` by 9 of its
    sds in one round). The change is applied, as a client's, where ``q`` stays proper."""
    config = config._replace(dpsgd=False, sampling="full", sampling_rate=1.0, clip_scaled=False)
    index = np.flatnonzero(np.asarray(refined))

    def prior_update(state, key):
        q = state.q
        if index.size == 0:  # every coordinate in p_G (flat priors among them): nothing to refine
            return state, jnp.zeros((), q.eta1.dtype)
        loc, _ = loc_cov_factor(q)

        def row_log_lik(theta_r, rows):
            return jnp.broadcast_to(remainder(loc.at[index].set(theta_r)), rows[0].shape[:1])

        rows, valid = [jnp.zeros((1,), q.eta1.dtype)], jnp.ones((1,), bool)
        q_r = marginal(q, index)
        cavity_r = tree_sub(q_r, _block(state.prior_factor, index))
        new_r, _, residual = optimize_local(key, row_log_lik, q_r, cavity_r, rows, valid, config, with_residual=True)
        change_r = tree_sub(new_r, q_r)
        change = GaussianNatural(jnp.zeros_like(q.eta1).at[index].set(change_r.eta1), _scatter(change_r.eta2, index, q))
        proposed = tree_add(q, change, damping)
        ok = proper(proposed)
        pick = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        prior_factor = pick(tree_add(state.prior_factor, change, damping), state.prior_factor)
        return state._replace(q=pick(proposed, q), prior_factor=prior_factor), residual

    return prior_update


def initial_state(
    prior: PriorSplit, num_clients: int, *, full_rank: bool = False, num_virtual=None, federation=None
) -> core.PVIState:
    """PVI's initial state (:func:`~numpyro_fed.infer.pvi.core.init`): ``q`` the prior when
    it is exact; otherwise ``prior.start``, its difference to the exact part shared by the
    clients' initial factors (public values, which each client's first update replaces), and
    the prior factor at zero. ``full_rank``: a full-rank ``q``."""
    base, start = prior.base, prior.start
    if full_rank:
        base, start = as_full(base), as_full(start)
    if prior.exact:
        return core.init(base, num_clients, num_virtual, federation=federation)
    share = jax.tree_util.tree_map(
        lambda s, b: jnp.broadcast_to((s - b) / num_clients, (num_clients,) + s.shape), start, base
    )
    zero = jax.tree_util.tree_map(jnp.zeros_like, base)
    return core.init(base, num_clients, num_virtual, factors=share, federation=federation, q=start, prior_factor=zero)
