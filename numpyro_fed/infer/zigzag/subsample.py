"""Subsampling with control variates (Bierkens, Fearnhead & Roberts 2019, "The Zig-Zag process
and super-efficient sampling for Bayesian analysis of big data").

With ``FedZigZag(model, subsample_size=b)`` a client ``m`` holding ``n_m`` rows checks a
proposal against an unbiased estimate of its rate built from ``b`` of its rows drawn at random
(with replacement) around the control variates' reference point ``x*``:

    d_i U_m(x) ~ d_i U_m(x*) + n_m / b * sum_{J in batch} (d_i U_J(x) - d_i U_J(x*))

(``d_i U_m(x*)`` is the client's full gradient at ``x*``, computed once at set-up; a client's
terms outside its data rows, e.g. the prior of a client-local latent variable, enter exactly).
It thins against a bound that needs no pass over the rows: if every row's Hessian satisfies
``|d_i d_k U_J(x)| <= H_ik`` for all ``x``, the estimate's rate along ``x + t v`` is at most

    max(0, v_i g_i + n_m sum_k H_ik |x_k - x*_k| + t n_m sum_k H_ik)

with ``g`` the client's share of the full gradient at ``x*`` (the first-order control
variates' shift): the :class:`~numpyro_fed.HessianBound` line bound with ``n_m H`` as the
client's row. A proposal then costs ``2 b`` row gradients (``b`` rows at ``x`` and at
``x*``) whatever the client's size.

The bounds ``H`` come from the clients, each from its own rows (:func:`row_curvature`):

* automatically, the largest ``|d_i d_k U_J|`` over the client's rows at a few points the
  server picks around the posterior (``x*``, ``x* +- 2.5 sd``, and the origin, where a
  GLM's curvature such as the logistic's ``|a_i a_k| / 4`` peaks), times a margin; the
  same rows' curvature at points one unit away from ``x*`` tells whether the curvature keeps
  growing (a log link): then the bound holds only near the posterior, and the run is warned
  and its violations counted;
* from the user (:class:`RowHessianBound`): a function of one row's model arguments giving a
  bound valid everywhere, for exactness.

**Importance sampling** (the server's thinning, in process) draws row ``J`` for a proposal of
coordinate ``i`` with probability proportional to the row's own curvature bound ``c_Ji = sum_k
H_Jik`` and weighs it by ``1 / (b p_Ji)``, so the estimate moves from ``g_i`` by at most
``S_i max_k |x_k - x*_k|``, ``S_i = sum_J c_Ji``. **Second order** (the default;
``control_variates="first_order"`` keeps the estimate above, with uniform batches through a
federation) keeps the client's Taylor term around ``x*`` whole (``g_m + H_m (x - x*)``, its
full gradient and Hessian at ``x*``) and samples only the remainder, rows drawn in proportion
to a bound ``kappa_Ji`` on their third derivative (from ``RowHessianBound(third=...)``, or
automatically, :func:`third_weights`), so that the sampled part moves by at most ``K_i |x -
x*|^2``, ``K_i = sum_J kappa_Ji``, which shrinks like ``n^{-1/2}`` in the posterior's units.
The weights are integers whose cumulative sums each client's rows keep (:class:`RowWeights`):
the probabilities are exact and a draw is a bisection. The estimates, their bounds and the
measurements: the guide, ``docs/guide/zigzag.md``, *Subsampling*.

With a preconditioner (in process), the process moves in ``u`` (``x = center + scale u``) and
everything above is done there: ``grad`` is a row's gradient in ``u``
(:func:`~numpyro_fed.infer.zigzag.preconditioning.preconditioned_row_grad`), so the curvatures,
weights and bounds are those of the potential of ``u``.

Everything a client computes here receives its own block only. Through a federation (the
clients' thinning) second order is the same estimate, the rows' weights, its gradient and
Hessian at ``x*`` computed once by each client and kept as its client state
(:class:`SubsampleState`, :func:`state_estimate`); what it sends the server is its bounds'
summaries (once, at set-up) and, in every round, the proposal Algorithm 2 sends. First order
through a federation draws uniform batches (the client sends its ``(d, d)`` curvature bound
once).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "AUTOMATIC_MARGIN",
    "THIRD_FLOOR",
    "THIRD_GROWTH",
    "RowHessianBound",
    "RowWeights",
    "SubsampleLayout",
    "SubsampleState",
    "gradient_estimate",
    "row_curvature",
    "importance_weights",
    "row_weights",
    "rows_per_estimate",
    "state_estimate",
    "subsample_layout",
    "subsampled_proposers",
    "third_weights",
    "valid_count",
]

#: the automatic per-row curvature bounds are multiplied by this (the curvature at the
#: points looked at is not a supremum in general)
AUTOMATIC_MARGIN = 1.25
#: rows whose Hessians one vectorized call of the set-up computes
CHUNK = 256
#: second order: every row's remainder bound gets this share of the client's mean (a row whose
#: third derivative vanishes where the set-up looked keeps a chance to be drawn)
THIRD_FLOOR = 0.05
#: second order: a third derivative this many times larger one unit from the reference point
#: than around the posterior is taken as growing without bound (a log link), and warned
THIRD_GROWTH = 2.0


class RowHessianBound(NamedTuple):
    """User-supplied bounds on every data row's curvature, for ``FedZigZag(subsample_size=...)``.

    ``rows(*row_arguments)`` receives **one row** of the model's row arguments (the
    arguments cut per client, in the order of :attr:`FederatedPotential.row_arguments
    <numpyro_fed.FederatedPotential>`, e.g. ``(x_J, y_J)`` for ``model(X, y)``) and returns a
    ``(d, d)`` array ``B`` with ``|d_i d_k U_J(x)| <= B[i, k]`` for every ``x`` (``U_J`` the
    row's term of the potential on the flat unconstrained space,
    :meth:`~numpyro_fed.FederatedPotential.ravel` gives the order). Each client evaluates
    it on its own rows (vectorized) and keeps ``n_m max_J B_J``. ``prior``: a ``(d, d)``
    bound on the prior's Hessian, or ``None``: the automatic one (the server's, from the
    prior alone). A client's terms outside its rows (client-local latent variables) get the
    automatic bound.

    ``third(*row_arguments)`` (optional), for second-order control variates: a ``(d,)`` array
    ``C`` with ``|w^T (d_i H_J(x)) w| <= C[i] |w|^2`` for every ``x`` and ``w`` (``d_i H_J``
    the derivative of the row's Hessian along coordinate ``i``; its largest eigenvalue in
    absolute value). With ``third``, subsampling in process uses second-order control variates
    and the rows' part of its bound comes from ``third`` alone (``rows`` is then unused);
    without it, first order against ``rows``.

    **Example**: logistic regression, ``|d_i d_k U_J| = s(1 - s) |a_i a_k| <= |a_i a_k| / 4``
    with ``a = x_J`` the row's covariates, and a ``Normal(0, 1)`` prior on the weights;
    ``d_i H_J = s'' a_i a a^T`` with ``|s''| <= 1 / (6 sqrt(3))``.

    >>> import jax.numpy as jnp, numpyro_fed as nf
    >>> bound = nf.RowHessianBound(lambda x, y: jnp.abs(jnp.outer(x, x)) / 4, prior=jnp.eye(2),
    ...                            third=lambda x, y: jnp.abs(x) * (x @ x) / (6 * jnp.sqrt(3.0)))
    >>> bound.rows(jnp.array([1.0, -2.0]), 1.0).tolist()
    [[0.25, 0.5], [0.5, 1.0]]
    """

    rows: Callable
    prior: Any = None
    third: Callable | None = None


class SubsampleLayout(NamedTuple):
    """How a client's block is subsampled: the data plate whose rows are drawn, whether the
    client's term has parts outside the rows (client-local latent variables), and the batch
    size ``b``."""

    plate: str
    client_terms: bool
    size: int


def subsample_layout(potential, size: int) -> SubsampleLayout:
    """The :class:`SubsampleLayout` of a :class:`~numpyro_fed.FederatedPotential`, or a
    ``ValueError`` naming what stands in the way (row-local or enumerated latents, several
    data plates, a batch larger than a client)."""
    data_plates = [p for p in potential.plates.values() if p.holds_data]
    if len(data_plates) != 1:
        raise ValueError(
            f"FedZigZag(subsample_size=...) needs exactly one federated data plate, found "
            f"{[p.name for p in data_plates]}: the batch is drawn from one plate's rows"
        )
    if potential.row_local_sites:
        raise ValueError(
            f"FedZigZag(subsample_size=...): the latent site(s) {list(potential.row_local_sites)} "
            "have one value per data row; a rate estimated from a few rows says nothing about the "
            "other rows' latents: pass subsample_size=None"
        )
    if potential.enumerated:
        raise ValueError(
            "FedZigZag(subsample_size=...) does not support enumerated discrete latents: pass subsample_size=None"
        )
    sizes = np.asarray(potential.client_sizes)
    if size > sizes.min():
        m = int(np.argmin(sizes))
        raise ValueError(
            f"subsample_size={size} is larger than client {m}'s {int(sizes[m])} rows: pass "
            f"subsample_size <= {int(sizes.min())} (the smallest client), or None for full-data rates"
        )
    client_terms = any(not p.holds_data for p in potential.plates.values())
    return SubsampleLayout(data_plates[0].name, bool(client_terms), int(size))


def rows_per_estimate(layout: SubsampleLayout) -> int:
    """Row gradients one estimate evaluates: the batch at ``x`` and at ``x*`` (and one masked
    row at each for the client-level terms)."""
    return 2 * layout.size + 2 * layout.client_terms


def _sub_block(block, plate: str, index, valid: bool):
    """The block made of rows ``index`` of ``block`` (all valid, or all masked)."""
    return {
        "client": block["client"],
        "rows": [jnp.take(a, index, axis=0) for a in block["rows"]],
        "index": {k: jnp.take(v, index, axis=0) for k, v in block["index"].items()},
        "valid": {k: jnp.full(index.shape, valid) for k in block["valid"]},
    }


def valid_count(valid):
    """The number of valid rows of a block's mask, whose valid rows come first (the layout of
    :attr:`FederatedPotential.client_data <numpyro_fed.FederatedPotential>`), by bisection:
    ``O(log n)`` reads, not a pass over the mask.

    >>> import jax.numpy as jnp
    >>> [int(valid_count(jnp.arange(5) < n)) for n in range(6)]
    [0, 1, 2, 3, 4, 5]
    """
    size = valid.shape[0]

    def halve(_, bounds):  # the count is in [low, high]
        low, high = bounds
        middle = (low + high) // 2
        more = valid[jnp.minimum(middle, size - 1)] & (low < high)
        return jnp.where(more, middle + 1, low), jnp.where(more | (low >= high), high, middle)

    low, _ = lax.fori_loop(
        0, int(np.ceil(np.log2(size + 1))) + 1, halve, (jnp.zeros((), jnp.int32), jnp.asarray(size, jnp.int32))
    )
    return low


def _estimate(grad, layout: SubsampleLayout, x, key, n, take, point, reference_grad):
    index = jax.random.randint(key, (layout.size,), 0, n)
    batch = take(index, True)
    both = jnp.stack([x, point])
    grads = jax.vmap(grad, in_axes=(0, None))(both, batch)
    scale = (n / layout.size).astype(x.dtype)
    estimate = reference_grad + scale * (grads[0] - grads[1])
    if layout.client_terms:  # the batch's block also holds the client-level terms once
        level = jax.vmap(grad, in_axes=(0, None))(both, take(index[:1], False))
        estimate = estimate - (scale - 1) * (level[0] - level[1])
    return estimate


def gradient_estimate(grad, layout: SubsampleLayout, x, key, block, point, reference_grad):
    """Client side: an unbiased estimate of the gradient of the client's term at ``x`` from
    ``layout.size`` of its rows drawn uniformly with replacement (the control-variate
    estimator above), reading only those rows.

    :param grad: ``(x, block) -> (d,)``, the gradient of the client's term given a block
        (:attr:`~numpyro_fed.infer.zigzag.ClientFunctions.grad`).
    :param point: the reference ``x*``; :param reference_grad: the client's full gradient there.
    """
    n = valid_count(block["valid"][layout.plate])
    return _estimate(grad, layout, x, key, n, partial(_sub_block, block, layout.plate), point, reference_grad)


def _around_and_away(values, num_bound: int):
    """``(2, ...)``: the largest of ``values`` ``(K, ...)`` over the first ``num_bound`` points
    (around the posterior) and over the others (one unit away)."""
    return jnp.stack([values[:num_bound].max(0), values[num_bound:].max(0)])


def _level_terms(grad, layout: SubsampleLayout, block, points, num_bound: int):
    """``(level, empty)``: the client-level terms' largest ``|d_i d_k C_m|`` ``(2, d, d)``
    (:func:`_around_and_away`; zero without them) and the block that holds only them (a
    masked row; ``None`` without them)."""
    d = points.shape[-1]
    if not layout.client_terms:
        return jnp.zeros((2, d, d), points.dtype), None
    empty = _sub_block(block, layout.plate, jnp.zeros(1, jnp.int32), False)
    level = jnp.abs(jax.vmap(jax.jacfwd(grad), in_axes=(0, None))(points, empty))  # (K, d, d)
    return _around_and_away(level, num_bound), empty


def _row_only(fn, layout: SubsampleLayout, block, empty, j):
    """``fn(block)`` of row ``j``'s own term: its one-row block holds the client-level terms
    once, which ``empty`` (:func:`_level_terms`) takes away."""
    value = fn(_sub_block(block, layout.plate, j[None], True))
    return value - fn(empty) if layout.client_terms else value


def _row_chunks(max_rows: int):
    """``(num_chunks, CHUNK)`` row indices covering ``range(max_rows)`` (the last chunk wraps
    around to the first rows): the set-up's vectorized passes over a client's rows."""
    num_chunks = -(-max_rows // CHUNK)
    return (jnp.arange(num_chunks * CHUNK) % max_rows).reshape(num_chunks, CHUNK)


def _row_terms(grad, layout: SubsampleLayout, block, bound_points, probe_points, row_bound=None, per_row: bool = False):
    """``(rows, level, weights)``: ``rows`` ``(2, d, d)``, the largest ``|d_i d_k U_J|`` over
    the valid rows (over ``bound_points``, and over ``probe_points``); ``level`` ``(2, d, d)``
    the same for the client-level terms (zero without them); with ``per_row``, ``weights``
    ``(n_max, d)``: each row's ``sum_k max |d_i d_k U_J|`` over ``bound_points`` (zero on the
    padding), else ``None``."""
    valid = block["valid"][layout.plate]
    max_rows = valid.shape[0]
    hessian = jax.jacfwd(grad)
    points = jnp.concatenate([bound_points, probe_points])
    num_bound = bound_points.shape[0]
    d = points.shape[-1]
    dtype = points.dtype
    level, empty = _level_terms(grad, layout, block, points, num_bound)

    if row_bound is None:

        def one_row(j):
            h = _row_only(partial(jax.vmap(hessian, in_axes=(0, None)), points), layout, block, empty, j)
            return _around_and_away(jnp.abs(h), num_bound) * valid[j]
    else:

        def one_row(j):
            rows = [a[j] for a in block["rows"]]
            bound = jnp.broadcast_to(jnp.abs(jnp.asarray(row_bound(*rows), dtype)), (d, d))
            return jnp.stack([bound, bound]) * valid[j]

    def chunk(js):
        h = jax.vmap(one_row)(js)  # (CHUNK, 2, d, d)
        return h.max(0), (h[:, 0].sum(-1) if per_row else None)

    rows, weights = lax.map(chunk, _row_chunks(max_rows))
    if per_row:
        weights = weights.reshape(-1, d)[:max_rows]
    return rows.max(0), level, weights


def row_curvature(grad, layout: SubsampleLayout, block, bound_points, probe_points, row_bound=None):
    """Client side (the set-up call ``"row_curvature"``): ``(2, d, d)``, the client's bound
    ``n_m max_J |d_i d_k U_J|`` (plus its client-level terms' ``|d_i d_k C_m|``) maximized
    over ``bound_points`` (``K, d``), and the same over ``probe_points``.

    With ``row_bound`` (a :class:`RowHessianBound`'s ``rows``) the rows' part is
    ``n_m max_J row_bound(rows_J)``, the same in both.
    """
    rows, level, _ = _row_terms(grad, layout, block, bound_points, probe_points, row_bound)
    n = jnp.sum(block["valid"][layout.plate])
    return n.astype(rows.dtype) * rows + level


class RowWeights(NamedTuple):
    """In process: the rows' sampling weights of every client and coordinate, for batches drawn
    in proportion to the rows' curvature (:func:`importance_weights`).

    Row ``J`` of a client is drawn for coordinate ``i`` with probability ``q_Ji / T_i``, the
    integers ``q_Ji = ceil(Q c_Ji / max_J c_Ji)`` (``c_Ji = sum_k max |d_i d_k U_J|``, the
    row's curvature bound; ``Q`` as large as int32 sums allow), so the probabilities are
    exact and a draw is a bisection of their cumulative sums.

    :ivar cumulative: ``(M, d, n_max)`` int32: ``sum_{K <= J} q_Ki`` (constant on the padding).
    :ivar sup: ``(M, d)``: ``T_i max_J c_Ji / q_Ji``: the estimate moves from its value at the
        reference point ``x*`` by at most ``sup_i max_k |x_k - x*_k|``.
    """

    cumulative: jax.Array
    sup: jax.Array


def row_weights(grad, layout: SubsampleLayout, block, bound_points, probe_points, row_bound=None):
    """Client side: ``(curvature, level, weights)``: what :func:`row_curvature` returns, the
    client-level terms' part of it alone, and every row's curvature bound ``c_J`` ``(n_max,
    d)`` (zero on the padding), for :func:`importance_weights`."""
    rows, level, weights = _row_terms(grad, layout, block, bound_points, probe_points, row_bound, per_row=True)
    n = jnp.sum(block["valid"][layout.plate])
    return n.astype(rows.dtype) * rows + level, level, weights


def importance_weights(weights) -> RowWeights:
    """The :class:`RowWeights` of the rows' curvature bounds ``weights`` ``(M, d, n_max)``.

    >>> import jax.numpy as jnp
    >>> w = importance_weights(jnp.array([[[1.0, 3.0, 0.0]]]))  # one client, d = 1, 3 rows
    >>> quanta = jnp.diff(w.cumulative[0, 0], prepend=0)
    >>> [round(float(q / quanta.sum()), 4) for q in quanta], round(float(w.sup[0, 0]), 4)  # sum 1 + 3
    ([0.25, 0.75, 0.0], 4.0)
    """
    levels = (2**31 - 1) // max(weights.shape[-1], 1) - 1
    largest = jnp.max(weights, -1, keepdims=True)
    scaled = jnp.ceil(weights / jnp.where(largest > 0, largest, 1.0) * levels)
    quanta = jnp.clip(scaled, 0, levels).astype(jnp.int32)
    cumulative = jnp.cumsum(quanta, -1, dtype=jnp.int32)
    ratio = jnp.max(jnp.where(quanta > 0, weights / jnp.maximum(quanta, 1), 0.0), -1)
    return RowWeights(cumulative, cumulative[..., -1].astype(weights.dtype) * ratio)


def _draw_rows(key, size: int, cumulative_of, max_rows: int, total):
    """``size`` row indices, row ``J`` with probability ``q_J / total`` (``cumulative_of``
    gathers the cumulative sums ``sum_{K <= J} q_K`` at an array of indices), by bisection:
    ``log2(n_max)`` gathers in a loop. Not unrolled: vmapped over the clients (a federation's
    rounds), the unrolled steps fused into kernels whose compilation (LLVM's vectorizer) grew
    faster than ``n_max`` (324 s at N = 1e5 against 35 s at 3e4; flat in a loop)."""
    target = jax.random.randint(key, (size,), 0, jnp.maximum(total, 1), jnp.int32)
    low = jnp.zeros(size, jnp.int32)
    high = jnp.full(size, max_rows - 1, jnp.int32)

    def halve(_, bounds):  # the first J with cumulative > target is in [low, high]
        low, high = bounds
        middle = (low + high) // 2
        above = cumulative_of(middle) > target
        return jnp.where(above, low, middle + 1), jnp.where(above, middle, high)

    low, _ = lax.fori_loop(0, max(int(np.ceil(np.log2(max_rows))), 0), halve, (low, high))
    return low


def _weighted_estimate(
    grad, layout: SubsampleLayout, x, key, take, point, reference_grad, cumulative_of, max_rows: int, hessian=None
):
    """The importance-sampled estimate for one coordinate ``i`` (``cumulative_of``: indices ->
    the cumulative integer weights of :class:`RowWeights` there):
    ``g + (C(x) - C(x*)) + 1 / b sum_J T / q_J (d U_J(x) - d U_J(x*))`` with ``b`` rows
    drawn with probabilities ``q_J / T`` (``C``: the client-level terms, exact). Its
    coordinate ``i`` is unbiased for the client's gradient there and moves from the
    reference by at most ``sup max_k |x_k - x*_k|``.

    With ``hessian`` (the client's Hessian at ``x*``, second order) every difference loses
    its linear part, ``H (x - x*)`` is added back whole, and the rows are those drawn in
    proportion to their remainder bounds (:func:`third_weights`):
    ``g + H (x - x*) + r_C(x) + 1 / b sum_J T / q_J r_J(x)``, ``r`` the remainders after the
    first-order Taylor term (``H_J (x - x*)`` is a forward pass through the row's gradient at
    ``x*``). Its coordinate ``i`` moves from the Taylor part by at most ``sup |x - x*|^2``."""
    total = cumulative_of(jnp.asarray(max_rows - 1, jnp.int32))
    index = _draw_rows(key, layout.size, cumulative_of, max_rows, total)
    quanta = cumulative_of(index) - jnp.where(index > 0, cumulative_of(jnp.maximum(index - 1, 0)), 0)
    step = x - point

    def differences_of(block):
        if hessian is None:
            grads = jax.vmap(grad, in_axes=(0, None))(jnp.stack([x, point]), block)
            return grads[0] - grads[1]
        at_point, linear = jax.jvp(lambda z: grad(z, block), (point,), (step,))
        return grad(x, block) - at_point - linear

    differences = jax.vmap(lambda j: differences_of(take(j[None], True)))(index)  # (b, d)
    estimate = reference_grad if hessian is None else reference_grad + hessian @ step
    if layout.client_terms:  # each row's block also holds the client-level terms once
        level = differences_of(take(index[:1], False))
        differences = differences - level
        estimate = estimate + level
    factor = jnp.where(quanta > 0, total.astype(x.dtype) / jnp.maximum(quanta, 1), 0.0) / layout.size
    return estimate + factor @ differences


class SubsampleState(NamedTuple):
    """What a client keeps between rounds for second-order subsampling through a federation
    (its client state; computed once, on its own rows, by the set-up call
    :func:`~numpyro_fed.infer.zigzag.subsample_setup.remainder_state`).

    :ivar cumulative: ``(d, n)`` int32, its rows' :class:`RowWeights` cumulative sums per
        coordinate (``n``: the largest client's rows; constant past its own).
    :ivar grad: ``(d,)`` its term's gradient at ``x*``; :ivar hessian: ``(d, d)`` its Hessian there.
    :ivar mean_hessian: ``(d, d)``: ``hess U(x*) / P``, the share of every proposer (from the server).
    :ivar prior_hessian: ``(d, d)``: the prior's Hessian at ``x*`` (from the server).
    """

    cumulative: jax.Array
    grad: jax.Array
    hessian: jax.Array
    mean_hessian: jax.Array
    prior_hessian: jax.Array


def state_estimate(grad, layout: SubsampleLayout, block, state: SubsampleState, point, x, key, coordinate):
    """Client side, second order through a federation: the estimate of its term's gradient at
    ``x`` whose ``coordinate`` is unbiased, from ``layout.size`` rows drawn in proportion to
    their remainder bounds along ``coordinate``, with what it keeps (``state``): the estimate
    the server's thinning makes in process (:func:`subsampled_proposers`), from the same weights."""
    return _weighted_estimate(
        grad,
        layout,
        x,
        key,
        partial(_sub_block, block, layout.plate),
        point,
        state.grad,
        lambda index: state.cumulative[coordinate, index],
        state.cumulative.shape[-1],
        state.hessian,
    )


def _row_third(grad, x, w, block):
    """``T[w, w]`` ``(d,)``: the third derivative of a block's potential at ``x`` in direction
    ``w`` twice (the derivative of the curvature along ``w``), two forward passes over its
    gradient."""
    hvp = lambda y: jax.jvp(lambda z: grad(z, block), (y,), (w,))[1]  # noqa: E731
    return jax.jvp(hvp, (x,), (w,))[1]


def _unit(w, fallback):
    norm = jnp.linalg.norm(w)
    return jnp.where(norm > 0, w / jnp.where(norm > 0, norm, 1.0), fallback)


def third_weights(grad, layout: SubsampleLayout, block, bound_points, probe_points, row_third=None):
    """Client side, for the second-order estimate (:func:`_weighted_estimate` with a
    Hessian): ``(level, kappa, spread)``.

    * ``level`` ``(2, d, d)``: the client-level terms' largest ``|d_i d_k C_m|`` over
      ``bound_points`` and over ``probe_points`` (zero without them), as in :func:`row_weights`;
    * ``kappa`` ``(n_max, d)``: every row's remainder bound, ``|r_Ji(x)| <= kappa_Ji
      |x - x*|^2`` with ``r_J(x) = d U_J(x) - d U_J(x*) - H_J(x*) (x - x*)`` (zero on the
      padding): ``sup |w^T (d_i H_J) w| / 2`` over unit ``w``, taken over the ``bound_points``
      (``K, d``; the first is ``x*``) and a few directions per row: the row's gradient at
      ``x*`` and two steps of the tensor power method from it (a GLM's row has one direction,
      its covariates, where the third derivative is largest for every ``i``: these find it),
      and the signs of ``bound_points``' offsets. With ``row_third`` (a
      :class:`RowHessianBound`'s ``third``) ``kappa_J = row_third(rows_J) / 2``, exact;
    * ``spread`` ``(2, d)``: ``sum_J`` of the same maxima over ``bound_points`` and over
      ``probe_points`` (whether the third derivative keeps growing away from the posterior).
    """
    valid = block["valid"][layout.plate]
    max_rows = valid.shape[0]
    points = jnp.concatenate([bound_points, probe_points])
    num_bound = bound_points.shape[0]
    d = points.shape[-1]
    dtype = points.dtype
    center = bound_points[0]
    offsets = jnp.sign(bound_points[1:] - center)
    fixed = jnp.concatenate([jnp.ones((1, d), dtype), offsets]) / jnp.sqrt(jnp.asarray(d, dtype))
    level, empty = _level_terms(grad, layout, block, points, num_bound)

    if row_third is None:

        def one_row(j):
            third = lambda x, w: _row_only(partial(_row_third, grad, x, w), layout, block, empty, j)  # noqa: E731
            w0 = _unit(_row_only(partial(grad, center), layout, block, empty, j), fixed[0])
            w1 = _unit(third(center, w0), w0)
            w2 = _unit(third(center, w1), w1)
            directions = jnp.concatenate([jnp.stack([w0, w1, w2]), fixed])
            values = jax.vmap(lambda x: jax.vmap(lambda w: jnp.abs(third(x, w)))(directions).max(0))(points)
            return _around_and_away(values / 2, num_bound) * valid[j]
    else:

        def one_row(j):
            rows = [a[j] for a in block["rows"]]
            bound = jnp.broadcast_to(jnp.abs(jnp.asarray(row_third(*rows), dtype)), (d,)) / 2
            return jnp.stack([bound, bound]) * valid[j]

    kappa = lax.map(jax.vmap(one_row), _row_chunks(max_rows)).reshape(-1, 2, d)[:max_rows]  # (n_max, 2, d)
    return level, kappa[:, 0], kappa.sum(0)


def subsampled_proposers(
    proposers, grad, data, num_clients: int, layout: SubsampleLayout, weights: RowWeights | None = None
):
    """``proposers`` (in process) with ``term_grad_estimate(x, j, key, reference, coordinate)``:
    proposer ``j``'s estimate from ``layout.size`` of its rows, gathered from the stacked
    blocks without a copy of the client's block (zero for the server's prior proposer, which
    holds no rows). With ``weights`` the rows are drawn in proportion to their curvature along
    ``coordinate`` (:func:`_weighted_estimate`); without, uniformly."""
    on_server = proposers.num > num_clients
    sizes = jnp.sum(data["valid"][layout.plate], axis=1)
    max_rows = data["valid"][layout.plate].shape[1]

    def term_grad_estimate(x, j, key, reference, coordinate):
        client = jnp.minimum(j, num_clients - 1)

        def take(index, valid):
            return {
                "client": data["client"][client],
                "rows": [a[client, index] for a in data["rows"]],
                "index": {k: v[client, index] for k, v in data["index"].items()},
                "valid": {k: jnp.full(index.shape, valid) for k in data["valid"]},
            }

        if weights is None:
            estimate = lambda: _estimate(
                grad,
                layout,
                x,
                key,
                sizes[client],
                take,
                reference.point,  # noqa: E731
                reference.term_grads[j],
            )
        else:
            estimate = lambda: _weighted_estimate(  # noqa: E731
                grad,
                layout,
                x,
                key,
                take,
                reference.point,
                reference.term_grads[j],
                lambda index: weights.cumulative[client, coordinate, index],
                max_rows,
                reference.term_hessians[j] if reference.second_order else None,
            )
        if not on_server:
            return estimate()
        return lax.cond(j == num_clients, lambda: jnp.zeros_like(x), estimate)

    return proposers._replace(term_grad_estimate=term_grad_estimate)
