"""The federated Zig-Zag process's data: its state, what a step reports, its settings."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.infer.zigzag.proposers import Proposers

__all__ = ["KernelConfig", "LineBound", "SampleInfo", "StepInfo", "ZigZagState"]


class LineBound(NamedTuple):
    """The switching-rate bound of the current line ``x + t v``, kept between proposals.

    A bound holds for the whole line it was built on, so after a rejected proposal, or when
    a sample is taken, the next proposals are drawn from the rest of it (the bounding
    processes are Poisson: memoryless) and nothing is re-evaluated. It is rebuilt after a
    switch or a redistribution of the prior, and when the line reaches its horizon, where
    the last grid point's values are reused as the new first one.

    :ivar valid: the bound belongs to the current line.
    :ivar position: time travelled on the line since the bound was built.
    :ivar reuse: ``end_grads``/``end_slopes`` hold the values at the current point.
    :ivar bound: grid bounds ``(K-1, P, d)`` per segment, or ``(2, P, d)``: the ``a`` and
        ``b`` of ``max(0, a + b t)`` for the line bounds.
    :ivar times: ``(K,)`` the grid's times (grid bounds only).
    :ivar end_grads: ``(P, d)`` gradients at the grid's last point; ``end_slopes`` their
        derivatives along ``v``.
    """

    valid: jax.Array
    position: jax.Array
    reuse: jax.Array
    bound: jax.Array
    times: jax.Array
    end_grads: jax.Array
    end_slopes: jax.Array


class ZigZagState(NamedTuple):
    """State of the federated Zig-Zag process: what the next step starts from, nothing else.

    :ivar x: position ``(d,)`` (flat, unconstrained; with a preconditioner, ``u``).
    :ivar v: velocity ``(d,)`` in ``{-1, +1}``.
    :ivar horizon: current horizon of the automatic bounds.
    :ivar prior_weights: ``(P,)`` shares of the prior, summing to one.
    :ivar line: the :class:`LineBound` of the current line.
    """

    x: jax.Array
    v: jax.Array
    horizon: jax.Array
    prior_weights: jax.Array
    line: LineBound


class StepInfo(NamedTuple):
    """What one step of the process did (:func:`~numpyro_fed.infer.zigzag.step`).

    :ivar elapsed: process time the step moved.
    :ivar proposed: a proposer's switching time was checked.
    :ivar accepted: the proposal was accepted: a velocity component flipped.
    :ivar violated: the exact rate exceeded its bound (the chain is then slightly biased).
    :ivar events_by_proposer: ``(P,)`` accepted switches per proposer (one-hot or zero).
    :ivar grad_evals_by_proposer: ``(P,)`` gradient evaluations per proposer: building a
        line's bound and the winner's check; each is one message a client sends.
    :ivar path_integral: ``(d,)`` integral of ``x(t)`` over the step's straight segment.
    :ivar path_square_integral: integral of ``x(t) x(t)^T``: ``(d,)`` (its diagonal) or
        ``(d, d)``.
    """

    elapsed: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    violated: jax.Array
    events_by_proposer: jax.Array
    grad_evals_by_proposer: jax.Array
    path_integral: jax.Array
    path_square_integral: jax.Array


class SampleInfo(NamedTuple):
    """The steps of one sample, accumulated (:func:`~numpyro_fed.infer.zigzag.advance`);
    ``MCMC`` records these as ``extra_fields=("info.<name>", ...)``.

    :ivar num_events: accepted switches.
    :ivar num_proposals: proposals (accepted or not).
    :ivar num_violations: proposals whose exact rate exceeded its bound.
    :ivar events_by_proposer: ``(P,)`` accepted switches per proposer.
    :ivar grad_evals_by_proposer: ``(P,)`` gradient evaluations per proposer.
    :ivar rounds: rounds of messages with the clients (in a federation: ``federation.map``
        calls; each is one message to every client and one :class:`~numpyro_fed.infer.zigzag.federated.Proposal`
        back). Zero when the server thins the proposals in this process.
    :ivar hit_event_cap: the sample stopped at ``max_proposals`` before its duration.
    :ivar elapsed: process time the sample covered.
    :ivar path_integral: ``(d,)`` integral of the piecewise-linear path ``x(t)`` (exact).
    :ivar path_square_integral: integral of ``x(t) x(t)^T``: ``(d,)`` or ``(d, d)``.
    :ivar skeleton_times: ``(S,)`` times (since the sample's start) of its first ``S``
        switches; ``skeleton_x``/``skeleton_v`` ``(S, d)`` the positions and new
        velocities there; ``skeleton_count`` how many switches there were (more than ``S``
        means the buffer overflowed).
    """

    num_events: jax.Array
    num_proposals: jax.Array
    num_violations: jax.Array
    events_by_proposer: jax.Array
    grad_evals_by_proposer: jax.Array
    hit_event_cap: jax.Array
    elapsed: jax.Array
    path_integral: jax.Array
    path_square_integral: jax.Array
    rounds: jax.Array
    skeleton_times: jax.Array
    skeleton_x: jax.Array
    skeleton_v: jax.Array
    skeleton_count: jax.Array

    @classmethod
    def zeros(
        cls, num_proposers: int, d: int, dtype, *, skeleton_size: int = 0, full_covariance: bool = False
    ) -> "SampleInfo":
        """An empty record (nothing has happened yet)."""
        count = jnp.zeros((), jnp.int32)
        return cls(
            num_events=count,
            num_proposals=count,
            num_violations=count,
            events_by_proposer=jnp.zeros(num_proposers, jnp.int32),
            grad_evals_by_proposer=jnp.zeros(num_proposers, jnp.int32),
            hit_event_cap=jnp.zeros((), bool),
            elapsed=jnp.zeros((), dtype),
            path_integral=jnp.zeros(d, dtype),
            path_square_integral=jnp.zeros((d,) * (2 if full_covariance else 1), dtype),
            rounds=count,
            skeleton_times=jnp.zeros(skeleton_size, dtype),
            skeleton_x=jnp.zeros((skeleton_size, d), dtype),
            skeleton_v=jnp.zeros((skeleton_size, d), dtype),
            skeleton_count=count,
        )


class KernelConfig(NamedTuple):
    """The settings of a kernel, fixed when it is built (:func:`~numpyro_fed.infer.zigzag.build_kernel`
    documents each one).

    :ivar proposers: the :class:`~numpyro_fed.infer.zigzag.Proposers`.
    :ivar str kind: ``"grid"``, ``"affine"``, ``"gradient"`` or ``"hessian"``.
    :ivar bounds: the user's bound laid out per proposer (``"gradient"``/``"hessian"``), else
        ``None``.
    :ivar excess: ``(P,)`` every proposer's excess (refreshment) rate, split evenly over
        coordinates.
    :ivar float redistribution_rate: rate of the prior's redistribution (0: none).
    :ivar int grid_size: ``K``.
    :ivar float safety_factor: multiplies the bounds.
    :ivar int max_proposals: proposals allowed per call of :func:`~numpyro_fed.infer.zigzag.advance`.
    :ivar bool batched: the kernel runs under ``vmap``.
    :ivar bool full_covariance: integrate ``x x^T`` in full.
    :ivar int skeleton_size: switches recorded per sample.
    """

    proposers: Proposers
    kind: str
    bounds: Any
    excess: jax.Array
    redistribution_rate: float
    grid_size: int
    safety_factor: float
    max_proposals: int
    batched: bool
    full_covariance: bool
    skeleton_size: int
