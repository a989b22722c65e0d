"""FedZigZag's settings, checked: every constructor argument of
:class:`~numpyro_fed.infer.zigzag.FedZigZag` (but the model, ``partition`` and
``init_strategy``) validated and resolved into :class:`ZigZagOptions`, and the privacy
guarantee those settings give (Theorem 5.1), a pure function of them.

Bad input gets a ``ValueError`` or ``TypeError`` naming the argument at fault; combinations
that the sampler does not support (e.g. subsampling with a privacy guarantee) are refused by
name here, before any model is traced.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from numpyro_fed._checks import check_int, check_positive, check_real
from numpyro_fed.federation import Federation, InProcess
from numpyro_fed.infer.zigzag.bounds import bound_kind
from numpyro_fed.infer.zigzag.proposers import PRIOR_MODES
from numpyro_fed.infer.zigzag.subsample import RowHessianBound
from numpyro_fed.privacy import switching_time_guarantee
from numpyro_fed.privacy.randomness import resolve_private_randomness

__all__ = ["THINNING", "ZigZagOptions", "check_options", "privacy_guarantee"]

#: who thins the proposals (``FedZigZag(thinning=...)``): ``"server"``, the superposition of
#: the clients' rates thinned by the server (their terms evaluated through the federation's
#: calls, for a backend whose clients run inside the server's program); ``"clients"``, every
#: client thinning its own proposals (one round of messages per switch); ``"auto"``, the first
#: where the federation runs in process (and the clients need no private randomness), else the
#: second. Both give the same process.
THINNING = ("auto", "server", "clients")


class ZigZagOptions(NamedTuple):
    """FedZigZag's checked settings, each under its constructor argument's name (see
    :class:`~numpyro_fed.infer.zigzag.FedZigZag`). ``excess_rate`` and ``control_variates``
    are those the run uses: with a privacy guarantee the calibrated rate and ``False``.

    ``federation`` is the one given, or a new :class:`~numpyro_fed.federation.InProcess` for
    ``None``; ``thinning`` is ``"server"`` or ``"clients"`` (``"auto"`` resolved, see :data:`THINNING`).

    :ivar privacy: the :class:`~numpyro_fed.privacy.PrivacyGuarantee` of ``dp_*``, or ``None``.
    """

    sample_interval: float | None
    control_variates: Any
    prior: str
    redistribution_rate: float
    excess_rate: float
    bounds: Any
    grid_size: int
    safety_factor: float
    initial_horizon: float
    max_proposals: int
    skeleton_size: int
    full_covariance: bool
    preconditioner: Any
    federation: Federation
    private_randomness: bool
    subsample_size: int | None
    thinning: str
    privacy: Any


def check_options(
    *,
    sample_interval=None,
    control_variates=None,
    prior="server",
    redistribution_rate=0.1,
    excess_rate=0.0,
    bounds="grid",
    grid_size=2,
    safety_factor=1.0,
    initial_horizon=0.1,
    max_proposals=1_000_000,
    dp_sensitivity=None,
    dp_epsilon=None,
    dp_delta=None,
    skeleton_size=0,
    full_covariance=False,
    preconditioner="auto",
    federation=None,
    private_randomness=None,
    subsample_size=None,
    thinning="auto",
) -> ZigZagOptions:
    """FedZigZag's arguments checked (in the order a user reads them in an error) and
    resolved: :class:`ZigZagOptions`."""
    if federation is None:  # one meaning of None: the clients in this process
        federation = InProcess()
    if not isinstance(federation, Federation):
        raise TypeError(
            f"federation must be a Federation (e.g. nf.RayFederation()) or None, got {type(federation).__name__}"
        )
    # client-private keys by default under a guarantee whenever the clients are separate parties
    dp_asked = dp_sensitivity is not None or dp_epsilon is not None or dp_delta is not None
    defaulted = private_randomness is None
    private_randomness = resolve_private_randomness(private_randomness, federation, dp_asked)
    thinning = resolve_thinning(thinning, federation, private_randomness, defaulted)
    if isinstance(preconditioner, str) and preconditioner not in ("auto", "laplace", "diagonal"):
        raise ValueError(
            f"preconditioner must be 'auto', None, 'laplace', 'diagonal' or an array, got {preconditioner!r}"
        )
    # the Laplace preconditioner wherever it is allowed (see resolve_preconditioner)
    if isinstance(preconditioner, str) and preconditioner == "auto":
        preconditioner = resolve_preconditioner(
            subsample_size is not None,
            dp_sensitivity is not None or dp_epsilon is not None or dp_delta is not None,
            sample_interval is not None,
        )
    skeleton_size = check_int(skeleton_size, "skeleton_size", minimum=0)
    sample_interval = None if sample_interval is None else check_positive(sample_interval, "sample_interval")
    if excess_rate is None or check_real(excess_rate, "excess_rate") < 0:
        raise ValueError(f"excess_rate must be >= 0, got {excess_rate}")
    subsample_size = None if subsample_size is None else check_int(subsample_size, "subsample_size", minimum=1)
    if subsample_size is None:
        if isinstance(bounds, RowHessianBound):
            raise ValueError(
                "bounds=RowHessianBound(...) bounds each row's curvature for subsampling: "
                "pass subsample_size (e.g. subsample_size=1) with it"
            )
        bound_kind(bounds)
    else:
        _check_subsampling(
            subsample_size,
            bounds,
            control_variates,
            preconditioner,
            thinning == "server",
            dp_sensitivity is not None or dp_epsilon is not None or dp_delta is not None,
        )
    grid_size = check_int(grid_size, "grid_size", minimum=2)
    safety = check_real(safety_factor, "safety_factor")
    if safety < 1:
        raise ValueError(f"safety_factor must be >= 1, got {safety_factor}")
    initial_horizon = check_positive(initial_horizon, "initial_horizon")
    max_proposals = check_int(max_proposals, "max_proposals", minimum=1)
    if prior not in PRIOR_MODES:
        raise ValueError(f"prior must be one of {PRIOR_MODES}, got {prior!r}")
    if prior == "redistribute":
        redistribution_rate = check_positive(redistribution_rate, "redistribution_rate")
    if not (
        control_variates is None
        or isinstance(control_variates, (bool, np.bool_))
        or control_variates in ("first_order", "second_order")
    ):
        raise ValueError(
            f"control_variates must be None, True, False, 'first_order' or 'second_order', got {control_variates!r}"
        )
    if control_variates == "second_order" and not isinstance(bounds, str) and subsample_size is None:
        raise ValueError(
            "control_variates='second_order' needs the automatic bounds ('grid' or 'affine'): "
            f"a {type(bounds).__name__} does not bound the linear part of the shift"
        )
    privacy, excess_rate = privacy_guarantee(
        dp_sensitivity,
        dp_epsilon,
        dp_delta,
        control_variates=control_variates,
        preconditioner=preconditioner,
        excess_rate=float(excess_rate),
    )
    if privacy is not None:  # the control variates' set-up rounds are not covered by the theorem
        control_variates = False
        privacy = privacy.replace(
            client_private_randomness=private_randomness,
            not_covered=privacy.not_covered
            + ("" if private_randomness else "; the server, which chose the keys of the clients' proposals"),
        )
    return ZigZagOptions(
        sample_interval=sample_interval,
        control_variates=control_variates,
        prior=prior,
        redistribution_rate=redistribution_rate,
        excess_rate=excess_rate,
        bounds=bounds,
        grid_size=grid_size,
        safety_factor=safety,
        initial_horizon=initial_horizon,
        max_proposals=max_proposals,
        skeleton_size=skeleton_size,
        full_covariance=bool(full_covariance),
        preconditioner=preconditioner,
        federation=federation,
        private_randomness=bool(private_randomness),
        subsample_size=subsample_size,
        thinning=thinning,
        privacy=privacy,
    )


def resolve_thinning(thinning, federation, private_randomness, defaulted=False) -> str:
    """``"server"`` or ``"clients"``: who thins the proposals (see :data:`THINNING`), checked
    against what the federation can do."""
    if thinning not in THINNING:
        raise ValueError(f"thinning must be one of {THINNING}, got {thinning!r}")
    if thinning == "auto":
        return "server" if federation.in_process and not private_randomness else "clients"
    if thinning == "server" and not federation.in_process:
        raise ValueError(
            f"thinning='server' evaluates every client's rate at every proposal, inside the "
            f"server's program: {type(federation).__name__} runs its clients elsewhere; pass "
            "thinning='clients' (or 'auto')"
        )
    if thinning == "server" and private_randomness:
        asked = (
            "a privacy guarantee with clients apart from the server (private_randomness=None, the default)"
            if defaulted
            else "private_randomness=True"
        )
        raise ValueError(
            f"{asked}: each client draws its own proposals from a key the server does not know, which "
            "needs thinning='clients' (or 'auto'); pass private_randomness=False for the server's thinning "
            "(the guarantee then does not hold against the server)"
        )
    return thinning


def resolve_preconditioner(subsampled: bool, private: bool, interval_given: bool):
    """``preconditioner="auto"``: the Laplace approximation at the mode (``"auto"`` is kept:
    the set-up falls back to none when the posterior has no mode), except with a privacy
    guarantee (the round of Hessians is not covered by Theorem 5.1), with subsampling (whose
    bounds and weights are set up for the unpreconditioned process by default; pass
    ``"laplace"`` for correlated parameters) and with a ``sample_interval`` given (a time in
    the model's units: the whitened process would make it one of posterior sds instead):
    there ``None``."""
    return None if subsampled or private or interval_given else "auto"


def _check_subsampling(subsample_size, bounds, control_variates, preconditioner, server_thinning, private):
    """Refuses, by name, what ``subsample_size`` does not support (``server_thinning``: the
    server thins the superposition in process; ``private``: a privacy guarantee is asked for)."""
    if not (isinstance(bounds, RowHessianBound) or bounds == "grid"):
        raise ValueError(
            f"subsample_size={subsample_size} thins against bounds on every row's curvature: "
            "leave bounds at its default (automatic, computed by each client from its rows) or "
            f"pass a RowHessianBound, not {bounds!r}"
        )
    if isinstance(bounds, RowHessianBound) and not callable(bounds.rows):
        raise TypeError(
            f"RowHessianBound.rows must be a function of one row's model arguments, got {type(bounds.rows).__name__}"
        )
    if control_variates is False:
        raise ValueError(
            f"subsample_size={subsample_size} estimates each rate around the control "
            "variates' reference point: control_variates=False is not supported with it "
            "(leave it at None, True or 'second_order')"
        )
    user_third = not isinstance(bounds, RowHessianBound) or bounds.third is not None
    if control_variates == "second_order" and not user_third:
        raise ValueError(
            "control_variates='second_order' with subsampling bounds the rows' remainders after "
            "their Taylor term: a RowHessianBound needs third=... for it (or pass "
            "control_variates=None for first order against its curvature bound)"
        )
    if isinstance(bounds, RowHessianBound) and bounds.third is not None and not callable(bounds.third):
        raise TypeError(
            f"RowHessianBound.third must be a function of one row's model arguments, got {type(bounds.third).__name__}"
        )
    if preconditioner is not None and not server_thinning:
        raise ValueError(
            f"subsample_size={subsample_size} with preconditioner={preconditioner!r} "
            "is supported with the server's thinning in process (federation=None or InProcess()), "
            "not with the clients' thinning: pass preconditioner=None or federation=None"
        )
    if private:
        raise ValueError(
            f"subsample_size={subsample_size} with a privacy guarantee (dp_sensitivity/"
            "dp_epsilon/dp_delta): Theorem 5.1 covers switching times thinned against a "
            "client's exact rate with refreshment; a rate estimated from random rows around "
            "a reference point (and the set-up rounds it needs) is not covered. Pass "
            "subsample_size=None for the guarantee"
        )


def privacy_guarantee(sensitivity, epsilon, delta, *, control_variates, preconditioner, excess_rate: float):
    """``(guarantee, excess_rate)``: the :class:`~numpyro_fed.privacy.PrivacyGuarantee` of
    Theorem 5.1 for ``dp_sensitivity``, ``dp_epsilon`` and ``dp_delta`` (``None`` when no
    sensitivity is given) and the excess rate the run uses (``excess_rate``, or with
    ``epsilon`` and no rate given, the one inequality (7) calibrates). Refuses the settings
    whose set-up rounds the theorem does not cover (control variates, a Laplace
    preconditioner).

    >>> guarantee, rate = privacy_guarantee(2.0, 1.0, 1e-5, control_variates=None, preconditioner=None,
    ...                                     excess_rate=0.0)
    >>> rate > 0, guarantee.epsilon <= 1.0  # the calibrated rate buys at least the epsilon asked for
    (True, True)
    """
    if sensitivity is None:
        if epsilon is not None or delta is not None:
            raise ValueError("dp_epsilon/dp_delta need dp_sensitivity (the bound K of Theorem 5.1)")
        return None, excess_rate
    if delta is None:
        raise ValueError("dp_sensitivity needs dp_delta")
    if control_variates:
        raise ValueError(
            f"control_variates={control_variates!r} with a privacy guarantee: the control "
            "variates' aggregation round is not covered by Theorem 5.1"
        )
    if isinstance(preconditioner, str):
        raise ValueError(
            f"preconditioner={preconditioner!r} with a privacy guarantee: the round of "
            "Hessians it needs is not covered by Theorem 5.1 (pass a fixed scale; K must then "
            "bound the change of the preconditioned intensities)"
        )
    excess_rate, guarantee = switching_time_guarantee(sensitivity, excess_rate, delta, epsilon=epsilon)
    return guarantee, excess_rate
