"""One FedZigZag draw: the state NumPyro carries from draw to draw
(:class:`FedZigZagState`) and the functions that make the first draw and the next, around
the core's kernel (the server thinning: :func:`~numpyro_fed.infer.zigzag.build_kernel`; the
clients thinning: :func:`~numpyro_fed.infer.zigzag.federated.build_federated_kernel`).

A draw runs the process for the warmup's current interval of process time, then lets the
warmup adapt (:mod:`~numpyro_fed.infer.zigzag.warmup`); with subsampling a warmup draw with
a violation grows the bound (:func:`~numpyro_fed.infer.zigzag.subsample_setup.grow_bound`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.infer.zigzag.control_variates import switched
from numpyro_fed.infer.zigzag.state import SampleInfo, ZigZagState
from numpyro_fed.infer.zigzag.warmup import WarmupState, init_warmup

__all__ = ["DrawSettings", "FedZigZagState", "FirstDraw", "first_draw", "next_draw"]


class FedZigZagState(NamedTuple):
    """NumPyro-facing state of :class:`~numpyro_fed.infer.zigzag.FedZigZag`.

    :ivar i: the sample index.
    :ivar z: the MCMC sample: unconstrained sites, as NumPyro's ``z``.
    :ivar core: the process's state (:class:`~numpyro_fed.infer.zigzag.ZigZagState`).
    :ivar info: what the last sample did (:class:`~numpyro_fed.infer.zigzag.SampleInfo`);
        read it with ``extra_fields=("info.num_events", "info.events_by_proposer", ...)``.
    :ivar rng_key: the key the next sample starts from (NumPyro replaces it to continue a
        chain with a new key, as in ``mcmc.post_warmup_state``).
    :ivar adapt: the warmup's state (:class:`~numpyro_fed.infer.zigzag.WarmupState`).
    :ivar bound_scale: with ``subsample_size``, the factor the rows' curvature bound is
        multiplied by (grown during warmup after a violation); else ``None``.
    """

    i: jax.Array
    z: dict
    core: ZigZagState
    info: SampleInfo
    rng_key: jax.Array
    adapt: WarmupState
    bound_scale: jax.Array | None = None


class DrawSettings(NamedTuple):
    """What :func:`next_draw` runs.

    :ivar kernel: the core, ``kernel(rng_key, core, duration, reference[, bound_scale=])``.
    :ivar adapt_update: the warmup's ``update(adapt, core, info, i)``.
    :ivar unravel: flat ``x`` to the sites' dict; :ivar to_x: ``u`` to ``x`` (preconditioning).
    :ivar use_cv: the kernel takes the warmup's control variates.
    :ivar grow_bound: with subsampling, ``grow_bound(bound_scale, info, i)``; else ``None``.
    :ivar keep_completed: on an engine, the host callback that keeps each completed draw
        (it returns 0); else ``None``.
    """

    kernel: Callable
    adapt_update: Callable
    unravel: Callable
    to_x: Callable
    use_cv: bool
    grow_bound: Callable | None = None
    keep_completed: Callable | None = None


def next_draw(settings: DrawSettings, state: FedZigZagState) -> FedZigZagState:
    """The next draw: the process run for the warmup's interval from ``state`` (a stalled
    chain stops), then the warmup's update."""
    adapt = state.adapt
    key, k_sample = jax.random.split(state.rng_key)
    duration = jnp.where(adapt.stalled, 0.0, adapt.interval)  # a stalled chain stops
    control = switched(adapt.reference, adapt.active) if settings.use_cv else None
    bound_scale = state.bound_scale
    if settings.grow_bound is None:
        core, info = settings.kernel(k_sample, state.core, duration, control)
    else:
        core, info = settings.kernel(k_sample, state.core, duration, control, bound_scale=bound_scale)
        bound_scale = settings.grow_bound(bound_scale, info, state.i)
    info = info._replace(hit_event_cap=info.hit_event_cap | adapt.stalled)
    adapt = settings.adapt_update(adapt, core, info, state.i)
    new = FedZigZagState(state.i + 1, settings.unravel(settings.to_x(core.x)), core, info, key, adapt, bound_scale)
    if settings.keep_completed is not None:  # the draw is complete: the host keeps it (a worker may fail next)
        done = jax.pure_callback(
            settings.keep_completed, jax.ShapeDtypeStruct((), jnp.int32), new, vmap_method="expand_dims"
        )
        new = new._replace(i=new.i + done)
    return new


class FirstDraw(NamedTuple):
    """What :func:`first_draw` starts a chain with.

    :ivar init_core: ``(u, rng_key) -> core state`` (the core's ``init``).
    :ivar num_proposers: ``P``; :ivar skeleton_size: and :ivar full_covariance: as the kernel's.
    :ivar reference: the control variates' :class:`~numpyro_fed.infer.zigzag.ControlVariates`
        (or ``None``); :ivar active: they are on from the first draw.
    :ivar interval: the first draw's duration.
    :ivar subsampled: the state carries the subsampling's ``bound_scale``.
    """

    init_core: Callable
    num_proposers: int
    skeleton_size: int
    full_covariance: bool
    reference: Any
    active: bool
    interval: float
    subsampled: bool
    unravel: Callable
    to_x: Callable


def first_draw(settings: FirstDraw, key, u) -> FedZigZagState:
    """The state before the first draw, the process at ``u`` with a random velocity."""
    k_velocity, key = jax.random.split(key)
    core = settings.init_core(u, k_velocity)
    info = SampleInfo.zeros(
        settings.num_proposers,
        u.shape[-1],
        u.dtype,
        skeleton_size=settings.skeleton_size,
        full_covariance=settings.full_covariance,
    )
    adapt = init_warmup(settings.reference, settings.active, u, settings.interval)
    bound_scale = jnp.ones((), u.dtype) if settings.subsampled else None
    return FedZigZagState(
        jnp.zeros((), jnp.int32), settings.unravel(settings.to_x(core.x)), core, info, key, adapt, bound_scale
    )
