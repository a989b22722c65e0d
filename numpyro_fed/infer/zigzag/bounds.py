"""Bounds on the switching rates along the current line, for Poisson thinning.

* ``"grid"`` (automatic, Andral & Kamatani 2024): over a horizon ``[0, H]``, ``K`` grid
  points give each rate and its slope (a gradient and a Jacobian-vector product), and the
  bound on a segment is ``max(f_k, f_{k+1}, where the tangents meet, 0)``.
* ``"affine"``: the rate's own tangent ``max(0, a + b t)`` at the start of the line, exact
  when the potential is quadratic.
* :class:`GradientBound` / :class:`HessianBound`: bounds the user derived (Appendices A and
  F of the paper), constant or affine in time.

Every function here is a client-side or server-side piece of one job: :func:`line_coefficients`
and :func:`build_grid` are what the clients compute (each its own row of the bound, from its
own gradients), :func:`current_line` is the server's decision to keep or rebuild.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.zigzag.control_variates import Shift, shift_at, shift_slope
from numpyro_fed.infer.zigzag.state import KernelConfig, LineBound, ZigZagState

__all__ = [
    "GradientBound",
    "HessianBound",
    "SampledRowBound",
    "bound_kind",
    "build_grid",
    "build_line",
    "current_line",
    "empty_line",
    "line_coefficients",
    "per_proposer_bound",
    "segment_bounds",
]


#: second-order subsampling: the rounding allowed in a rate's Taylor part, in ulps of its terms
ROUNDING_ULPS = 64


class GradientBound(NamedTuple):
    """User-supplied bounds on the gradients: constant switching-rate bounds.

    ``|d_i U_m(x)| <= clients[m, i]`` and ``|d_i U_0(x)| <= prior[i]`` for every ``x``, with
    ``U_m`` client ``m``'s potential and ``U_0`` the prior's (everything outside the
    federated plates, Jacobians included), on the flat unconstrained space
    (:meth:`~numpyro_fed.FederatedPotential.ravel` gives the order). Each proposer's rate is
    then bounded by a constant, the next switching time is drawn exactly, and only the winner
    evaluates its gradient: no gradient is evaluated to propose (Appendix F.3 of the paper:
    heavy-tailed likelihoods have bounded gradients).

    :ivar clients: broadcastable to ``(M, d)``, finite and ``>= 0``; each client computes its
        own row from its own data.
    :ivar prior: broadcastable to ``(d,)``, finite and ``>= 0``.

    With control variates, each rate is shifted by a constant ``c`` and its bound grows by
    ``|c|`` (added automatically). A bound the rate exceeds is counted as a violation and
    reported by :meth:`~numpyro_fed.FedZigZag.check_run`.

    **Example**

    >>> import numpy as np, numpyro_fed as nf
    >>> bound = nf.GradientBound(clients=np.full((4, 1), 25.0), prior=0.1)  # 4 clients, d = 1
    >>> bound.clients.shape
    (4, 1)
    """

    clients: jax.Array
    prior: jax.Array = 0.0


class HessianBound(NamedTuple):
    """User-supplied bounds on the Hessians: switching-rate bounds affine in time.

    ``|d_i d_k U_m(x)| <= clients[m, i, k]`` and ``|d_i d_k U_0(x)| <= prior[i, k]`` for
    every ``x`` (notation as in :class:`GradientBound`). Along a line ``x + t v`` the rate of
    coordinate ``i`` then grows at most like ``sum_k H_ik t`` (Appendix A of the paper), and
    the first event of ``max(0, a + b t)`` is drawn exactly:

    * without control variates ``a`` is the rate at ``t = 0``: one gradient per proposer
      and proposal, no Hessian-vector product;
    * with control variates (reference point ``x*``), ``a = v_i d_i U(x*) / P +
      (H |x - x*|)_i``: **no gradient at all** to propose, only the winner evaluates its
      own (the super-efficient regime of Bierkens, Fearnhead & Roberts 2019).

    For a logistic regression client with rows ``X_m``: ``clients[m] = |X_m|^T |X_m| / 4``;
    for a ``Normal(0, s)`` prior on every coordinate: ``prior = eye(d) / s**2``.

    :ivar clients: broadcastable to ``(M, d, d)``, finite and ``>= 0``.
    :ivar prior: broadcastable to ``(d, d)``, finite and ``>= 0``.

    **Example**

    >>> import numpy as np, numpyro_fed as nf
    >>> X = np.ones((2, 10, 3))  # 2 clients, 10 rows each, d = 3
    >>> bound = nf.HessianBound(clients=np.abs(X).transpose(0, 2, 1) @ np.abs(X) / 4, prior=np.eye(3))
    >>> bound.clients.shape, float(bound.clients[0, 0, 0])
    ((2, 3, 3), 2.5)
    """

    clients: jax.Array
    prior: jax.Array = 0.0


class SampledRowBound(NamedTuple):
    """The bound of subsampling with rows drawn in proportion to their curvature (in
    process; see :mod:`~numpyro_fed.infer.zigzag.subsample`): a :class:`HessianBound` for
    the exactly computed terms (``clients``: a client's terms outside its rows; ``prior``)
    plus, per proposer and coordinate, ``sup``: the importance-sampled rows' estimate moves
    from its value at the reference point ``x*`` by at most ``sup_i max_k |x_k - x*_k|``.

    With second-order control variates (``second`` given) the estimate is the Taylor part
    ``g + H (x - x*)`` (exact: the rates' affine part along the line) plus importance-sampled
    remainders at most ``second_i |x - x*|^2`` (Euclidean), and ``clients``/``prior`` bound
    the exactly computed terms' Hessians' variation ``|H(x) - H(x*)|``. ``|x + t v - x*|^2``
    is quadratic in ``t``: on ``[0, horizon]`` it is at most its chord's affine bound
    ``|x - x*|^2 + t (2 (x - x*).v + d horizon)``, so the line's bound holds up to
    ``horizon`` and is rebuilt there.

    :ivar clients: ``(P, d, d)``. :ivar prior: ``(d, d)``. :ivar sup: ``(P, d)``.
    :ivar second: ``(P, d)`` or ``None`` (first order). :ivar horizon: ``()``, with ``second``.
    """

    clients: jax.Array
    prior: jax.Array
    sup: jax.Array
    second: jax.Array | None = None
    horizon: jax.Array | None = None


def bound_kind(bounds) -> str:
    """``"grid"``, ``"affine"``, ``"gradient"`` or ``"hessian"``; a ``ValueError`` otherwise.

    >>> bound_kind("grid"), bound_kind(GradientBound(1.0))
    ('grid', 'gradient')
    """
    if isinstance(bounds, GradientBound):
        return "gradient"
    if isinstance(bounds, (HessianBound, SampledRowBound)):
        return "hessian"
    if isinstance(bounds, str) and bounds in ("grid", "affine"):
        return bounds
    raise ValueError(f"bounds must be 'grid', 'affine', a GradientBound or a HessianBound, got {bounds!r}")


def per_proposer_bound(bound, num_clients: int, num_proposers: int, d: int, dtype):
    """The user's client/prior bound arrays, checked and laid out per proposer (a zero row
    for the server's prior proposer, which has no own term).

    >>> b = per_proposer_bound(GradientBound(2.0, 0.5), 3, 4, 2, float)
    >>> b.clients.shape, b.clients[-1].tolist(), b.prior.tolist()
    ((4, 2), [0.0, 0.0], [0.5, 0.5])
    """
    trailing = (d,) if isinstance(bound, GradientBound) else (d, d)
    name = type(bound).__name__
    arrays = []
    for field, shape in (("clients", (num_clients,) + trailing), ("prior", trailing)):
        value = np.asarray(getattr(bound, field), dtype=float)
        try:
            value = np.broadcast_to(value, shape)
        except ValueError:
            raise ValueError(
                f"{name}.{field} must broadcast to {shape} (M={num_clients} clients, d={d} "
                f"unconstrained coordinates), got shape {value.shape}"
            ) from None
        if not np.all(np.isfinite(value)) or np.any(value < 0):
            raise ValueError(f"{name}.{field} must be finite and >= 0")
        arrays.append(value)
    clients, prior = arrays
    if num_proposers > num_clients:
        clients = np.concatenate([clients, np.zeros((1,) + trailing)])
    return type(bound)(jnp.asarray(clients, dtype), jnp.asarray(prior, dtype))


def empty_line(kind: str, grid_size: int, num: int, d: int, dtype) -> LineBound:
    """A :class:`LineBound` of the right shapes that holds no bound yet."""
    rows = grid_size - 1 if kind == "grid" else 2
    return LineBound(
        valid=jnp.zeros((), bool),
        position=jnp.zeros((), dtype),
        reuse=jnp.zeros((), bool),
        bound=jnp.zeros((rows, num, d), dtype),
        times=jnp.zeros(grid_size, dtype),
        end_grads=jnp.zeros((num, d), dtype),
        end_slopes=jnp.zeros((num, d), dtype),
    )


def segment_bounds(times, rates, slopes):
    """Upper bounds of signed rates on each segment of a grid, from values and slopes.

    :param times: ``(K,)`` grid times. :param rates: ``(K, ...)`` signed rates at the grid
        points. :param slopes: ``(K, ...)`` their time derivatives.
    :return: ``(K-1, ...)`` bounds, non-negative: ``max(f_k, f_{k+1}, tangent meeting, 0)``.

    >>> import jax.numpy as jnp
    >>> float(segment_bounds(jnp.array([0.0, 2.0]), jnp.array([0.0, 0.0]), jnp.array([1.0, -1.0]))[0])
    1.0
    """
    t0, t1 = times[:-1], times[1:]
    shape = (-1,) + (1,) * (rates.ndim - 1)
    t0, t1 = t0.reshape(shape), t1.reshape(shape)
    f0, f1, s0, s1 = rates[:-1], rates[1:], slopes[:-1], slopes[1:]
    # Tangent lines f0 + s0 (t - t0) and f1 + s1 (t - t1) meet where a rising rate turns.
    denominator = s0 - s1
    safe = jnp.where(denominator > 0, denominator, 1.0)
    t_meet = (f1 - f0 + s0 * t0 - s1 * t1) / safe
    inside = (denominator > 0) & (t_meet > t0) & (t_meet < t1)
    meet_value = jnp.where(inside, f0 + s0 * (t_meet - t0), -jnp.inf)
    return jnp.maximum(jnp.maximum(f0, f1), jnp.maximum(meet_value, 0.0))


def _grads_and_slopes(config: KernelConfig, x, v, weights):
    """``((P, d), (P, d))``: every proposer's term ``T_j + w_j U_0``: gradient and slope."""
    term_g, term_s = config.proposers.term_grads_and_slopes(x, v)
    prior_g, prior_s = config.proposers.prior_grad_and_slope(x, v)
    return term_g + weights[:, None] * prior_g, term_s + weights[:, None] * prior_s


def line_coefficients(config: KernelConfig, state: ZigZagState, shift: Shift):
    """``(a, b)``, each ``(P, d)``: every rate is at most ``max(0, a + b t)`` along the
    current line (``"affine"``: the rate's own tangent at ``t = 0``)."""
    x, v, weights = state.x, state.v, state.prior_weights
    proposers, bounds = config.proposers, config.bounds
    if config.kind == "affine":
        grads, slopes = _grads_and_slopes(config, x, v, weights)
        return v * (grads - shift_at(shift, x)), v * (slopes - shift_slope(shift, v))
    if config.kind == "gradient":
        gradient_bound = bounds.clients + weights[:, None] * bounds.prior
        return gradient_bound + jnp.abs(shift.constant), jnp.zeros_like(gradient_bound)
    hessian = bounds.clients + weights[:, None, None] * bounds.prior  # (P, d, d)
    growth = hessian.sum(-1)
    sup = getattr(bounds, "sup", None)
    if sup is not None:  # |y_k - x*_k| <= max_k |x_k - x*_k| + t along the line
        growth = growth + sup
    reference = shift.reference
    if reference is None:
        prior_grad = proposers.prior_grad_and_slope(x, jnp.zeros_like(x))[0]
        grads = proposers.term_grads(x) + weights[:, None] * prior_grad
        return v * grads, growth
    # |d_i T_j(y) - d_i T_j(x*)| <= sum_k H_jik |y_k - x*_k| <= (H_j |x - x*|)_i + t (H_j 1)_i
    mean_gradient = (reference.term_grads.sum(0) + reference.prior_grad) / config.proposers.num
    distance = jnp.abs(x - reference.point)
    second = getattr(bounds, "second", None)
    if second is not None:  # the Taylor part, exact and affine along the line, plus the remainders
        mean_hessian = (reference.term_hessians.sum(0) + reference.prior_hessian) / config.proposers.num
        step = x - reference.point
        d = x.shape[0]
        # the rate's Taylor part is computed as a sum of terms that cancel (each proposer's gradient
        # and shift): their rounding, exact terms' scale times a few ulps, is part of the bound
        magnitude = (
            jnp.abs(reference.term_grads)
            + jnp.abs(mean_gradient)
            + (jnp.abs(reference.term_hessians) + jnp.abs(mean_hessian)) @ distance
            + weights[:, None] * (jnp.abs(reference.prior_grad) + jnp.abs(reference.prior_hessian) @ distance)
        )
        rounding = ROUNDING_ULPS * jnp.finfo(x.dtype).eps * magnitude
        a = v * (mean_gradient + mean_hessian @ step) + hessian @ distance + second * (step @ step) + rounding
        b = v * (mean_hessian @ v) + growth + second * (2 * (step @ v) + d * bounds.horizon)
        return a, b
    a = v * mean_gradient + hessian @ distance
    if sup is not None:
        a = a + sup * jnp.max(distance)
    return a, growth


def build_line(config: KernelConfig, state: ZigZagState, shift: Shift) -> LineBound:
    """The bound ``max(0, a + b t)`` of the current line (every bound kind but the grid)."""
    a, b = line_coefficients(config, state, shift)
    dtype = state.x.dtype
    return state.line._replace(
        valid=jnp.ones((), bool),
        position=jnp.zeros((), dtype),
        reuse=jnp.zeros((), bool),
        bound=config.safety_factor * jnp.stack([a, b]),
    )


def build_grid(config: KernelConfig, state: ZigZagState, shift: Shift) -> LineBound:
    """Grid bound over ``[0, horizon]``. At a horizon the values at ``t = 0`` are the last
    grid point's, kept in the line bound, and a single chain evaluates the other ``K - 1``
    points only; otherwise (and under ``vmap``, where both branches of a conditional run) all
    ``K`` points are evaluated in one batch (one batched call costs much less than ``K``
    single ones on CPU)."""
    line, dtype = state.line, state.x.dtype
    times = jnp.linspace(0.0, 1.0, config.grid_size, dtype=dtype) * state.horizon
    excess = config.excess.astype(dtype) / state.x.shape[0]

    def at(ts):  # (len(ts), P, d): every proposer's gradient and slope at x + t v
        return jax.vmap(lambda t: _grads_and_slopes(config, state.x + t * state.v, state.v, state.prior_weights))(ts)

    def reusing():
        grads, slopes = at(times[1:])
        return (jnp.concatenate([line.end_grads[None], grads]), jnp.concatenate([line.end_slopes[None], slopes]))

    grads, slopes = at(times) if config.batched else lax.cond(line.reuse, reusing, lambda: at(times))
    shifts = shift_at(shift, state.x)
    shift_slopes = shift_slope(shift, state.v)
    if shift.weights is not None:  # the shift moves along the line: c + A (x + t v - x*)
        shifts = shifts + times[:, None, None] * shift_slopes
    signed = state.v * (grads - shifts)
    bound = config.safety_factor * segment_bounds(times, signed, state.v * (slopes - shift_slopes)) + excess[:, None]
    return line._replace(
        valid=jnp.ones((), bool),
        position=jnp.zeros((), dtype),
        reuse=jnp.zeros((), bool),
        bound=bound,
        times=times,
        end_grads=grads[-1],
        end_slopes=slopes[-1],
    )


def _evaluations_per_line(config: KernelConfig, shift: Shift) -> int:
    """Gradient evaluations every proposer makes to build a non-grid line bound."""
    if config.kind == "affine":
        return 1
    if config.kind == "hessian":
        return 0 if shift.reference is not None else 1
    return 0


def current_line(config: KernelConfig, state: ZigZagState, shift: Shift):
    """``(line bound, gradient evaluations per proposer)``: the server keeps the current
    line's bound, or has the clients rebuild it (grid, at the horizon: from the last grid
    point's values)."""
    line = state.line
    count = lambda n: jnp.asarray(n, dtype=jnp.int32)  # noqa: E731
    if config.kind != "grid":
        return lax.cond(
            line.valid,
            lambda: (line, count(0)),
            lambda: (build_line(config, state, shift), count(_evaluations_per_line(config, shift))),
        )
    return lax.cond(
        line.valid & (line.position < line.times[-1]),
        lambda: (line, count(0)),
        lambda: (
            build_grid(config, state, shift),
            count(jnp.where(line.reuse, config.grid_size - 1, config.grid_size)),
        ),
    )
