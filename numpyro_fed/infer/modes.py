"""What the samplers' set-ups share when they look for the posterior's mode from two starts
(FedZigZag's reference point, D-ADMMS's ``rho="auto"`` scaling, DSVGD's start): the second start,
the Laplace approximation at a search's end, and the choice between the modes the two searches
found.

A sampler that starts at the mode its set-up found stays near it when the posterior has
separated modes (a mixture's label-swapped one), so where one search ended decided the answer.
Each set-up searches again from :func:`second_start` and keeps, by :func:`compare_modes`, the
mode whose Laplace approximation holds more of the mass.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer.initialization import init_to_median, init_to_uniform

__all__ = ["OTHER_MODE_WARNING", "Laplace", "ModeComparison", "compare_modes", "laplace", "second_start"]

#: the share of the posterior mass (by Laplace approximations) a second mode must hold for a
#: set-up to warn that the run, which starts at the other, may miss it
OTHER_MODE_WARNING = 0.01


def second_start(potential, init_strategy, rng_key, dtype):
    """The flat start ``(d,)`` of a mode search's second run: the prior's medians
    (``init_to_median(num_samples=15)``), or where ``init_strategy`` is that already a point of
    ``init_to_uniform``; ``None`` where it is not finite (e.g. a median of a deployment's
    stand-in arguments). ``potential``: the
    :class:`~numpyro_fed.FederatedPotential` (its :meth:`~numpyro_fed.FederatedPotential.init_point`)."""
    median = getattr(init_strategy, "func", init_strategy) is init_to_median
    strategy = init_to_uniform if median else init_to_median(num_samples=15)
    start = potential.ravel(potential.init_point(strategy, rng_key)).astype(dtype)
    return start if bool(jnp.all(jnp.isfinite(start))) else None


class Laplace(NamedTuple):
    """The Laplace approximation at a point (:func:`laplace`).

    :ivar log_mass: ``-U - log det(H) / 2`` (up to a constant shared by every point): what
        :func:`compare_modes` compares; not finite where ``H`` is not positive definite.
    :ivar sd: ``sqrt(diag(H^-1))``, the approximation's sds.
    :ivar chol: the lower Cholesky factor of ``H`` (not finite where ``H`` is not positive
        definite), for a Newton step ``cho_solve((chol, True), grad)``.
    """

    log_mass: jax.Array
    sd: jax.Array
    chol: jax.Array


def laplace(value, hessian) -> Laplace:
    """The Laplace approximation at a point where the potential is ``value`` and its Hessian
    ``hessian`` (``(d, d)``, symmetrised here), traceable: the one computation behind
    FedZigZag's mode test and DSVGD's choice of start.

    >>> import jax.numpy as jnp
    >>> approx = laplace(jnp.asarray(1.0), jnp.diag(jnp.array([4.0, 0.25])))
    >>> float(approx.log_mass), approx.sd.tolist()
    (-1.0, [0.5, 2.0])
    """
    h = (hessian + hessian.T) / 2
    chol = jnp.linalg.cholesky(h)
    eye = jnp.eye(h.shape[0], dtype=h.dtype)
    sd = jnp.sqrt(jnp.diag(jax.scipy.linalg.cho_solve((chol, True), eye)))
    return Laplace(-value - jnp.sum(jnp.log(jnp.diag(chol))), sd, chol)


class ModeComparison(NamedTuple):
    """Two separated modes, compared by :func:`compare_modes`.

    :ivar take_second: whether the second holds more of the mass.
    :ivar distance: ``max_i |x_i - y_i| / min(sd_x_i, sd_y_i)``, in Laplace posterior sds.
    :ivar share: the share of the two modes' mass that the other (the one not taken) holds.
    """

    take_second: bool
    distance: float
    share: float


def compare_modes(first, second, *, separation: float = 3.0) -> ModeComparison | None:
    """Of two modes, each ``(point, laplace_sd, laplace_log_mass)`` (the log mass ``-U - log
    det(H) / 2``, up to a constant shared by every mode), which holds more of the mass by their
    Laplace approximations, or ``None`` where they are one mode: closer than ``separation``
    Laplace sds (of either) in every coordinate.

    >>> import numpy as np
    >>> compare_modes((np.array([-3.0]), np.ones(1), -6.0), (np.array([3.0]), np.ones(1), 0.0))
    ModeComparison(take_second=True, distance=6.0, share=0.0024726231566347743)
    >>> compare_modes((np.zeros(1), np.ones(1), 0.0), (np.full(1, 0.01), np.ones(1), 0.0)) is None
    True
    """
    (x, sd_x, mass_x), (y, sd_y, mass_y) = first, second
    gap = np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))
    sd = np.minimum(np.asarray(sd_x, np.float64), np.asarray(sd_y, np.float64))
    distance = float(np.max(gap / sd))
    if not distance > separation:
        return None
    take_second = bool(mass_y > mass_x)
    lead = abs(float(mass_y) - float(mass_x))
    return ModeComparison(take_second, distance, 1.0 / (1.0 + math.exp(min(lead, 700.0))))
