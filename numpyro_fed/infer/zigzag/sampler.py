"""The NumPyro face of the federated Zig-Zag sampler: an ``MCMCKernel`` over the core."""

from __future__ import annotations

import hashlib
from functools import partial
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer.initialization import init_to_uniform
from numpyro.util import is_prng_key

from numpyro_fed._checks import check_int, check_positive, check_real, user_origin, warn_user
from numpyro_fed.infer.kernel import FederatedMCMCKernel, RunCheck
from numpyro_fed.infer.zigzag.bounds import HessianBound, SampledRowBound, bound_kind, per_proposer_bound
from numpyro_fed.infer.zigzag.subsample import (
    AUTOMATIC_MARGIN,
    THIRD_FLOOR,
    THIRD_GROWTH,
    RowHessianBound,
    importance_weights,
    row_curvature,
    row_weights,
    third_weights,
    rows_per_estimate,
    subsample_layout,
    subsampled_proposers,
)
from numpyro_fed.infer.zigzag.control_variates import control_variate_reference, switched
from numpyro_fed.infer.zigzag.diagnostics import (
    DIAGNOSTICS,
    SKELETON,
    TRAJECTORY,
    few_effective_draws,
    per_client_stats,
    rate_problems,
    skeleton_of,
    trajectory_moments_of,
)
from numpyro_fed.infer.zigzag.kernel import build_kernel, init
from numpyro_fed.infer.zigzag.mode import describe_no_mode, find_mode
from numpyro_fed.infer.zigzag.preconditioning import (
    laplace_preconditioner,
    precondition,
    preconditioned_bound,
    preconditioned_row_grad,
    user_preconditioner,
)
from numpyro_fed.infer.zigzag.proposers import PRIOR_MODES, proposers_from_potential
from numpyro_fed.infer.zigzag.state import SampleInfo, ZigZagState
from numpyro_fed.infer.zigzag.warmup import (
    DEFAULT_INTERVAL,
    INITIAL_INTERVAL,
    WarmupState,
    init_warmup,
    warmup_adaptation,
)
from numpyro_fed.federation import Federation, InProcess
from numpyro_fed.infer.zigzag.federated import build_federated_kernel, federated_init
from numpyro_fed.infer.zigzag.proposers import client_functions
from numpyro_fed.infer.zigzag.control_variates import ControlVariates
from numpyro_fed.infer.zigzag.setup import ClientTerms, SetupTally, federated_reference, setup_functions
from numpyro_fed.federation.ledger import DIRECTIONS
from numpyro_fed.privacy import switching_time_guarantee

__all__ = ["FedZigZag", "FedZigZagState"]


def _program_key(*parts):
    """A digest of what the clients' program depends on (their rows and its settings)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(parts):
        array = np.asarray(leaf)
        digest.update(repr((array.shape, array.dtype.str)).encode())
        digest.update(array.tobytes() if array.dtype != object else repr(leaf).encode())
    return digest.hexdigest()


class _PrivateSeed:
    """Runs where a client lives (``client_program(transform=...)``): its block and a seed
    drawn there from the operating system's entropy, which the server never sees."""

    def __call__(self, block):
        import secrets

        return {"rows": block, "seed": np.uint32(secrets.randbits(32))}


def _on_rows(fn, block, *args):
    return fn(block["rows"], *args)


def _with_private_key(propose, key_index, block, *args):
    """The client's round with its key folded with its private seed: the server sent a key
    (``args[key_index]``), and cannot know the one the client draws its proposals from."""
    args = list(args)
    key = args[key_index]
    if not (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
            or (key.dtype == jnp.uint32 and key.shape[-1:] == (2,))):
        raise RuntimeError(f"FedZigZag(private_randomness=True): argument {key_index} of the clients' "
                           f"round is not its key (dtype {key.dtype}, shape {key.shape}): the round's "
                           "arguments changed order")
    args[key_index] = jax.random.fold_in(key, block["seed"])
    return propose(block["rows"], *args)


def _carry_ledger(previous, ledger):
    """Adds the counts of ``previous`` (a :class:`~numpyro_fed.federation.MessageLedger`) to
    ``ledger``: a restarted federation keeps what its set-up calls sent."""
    for name in previous.names:
        for direction in DIRECTIONS:
            messages, nbytes = previous.count(name, direction, "messages"), previous.count(name, direction, "bytes")
            if messages.any() or nbytes.any():
                ledger.add(name, direction, None, messages=messages, nbytes=nbytes)
        rounds = previous.rounds(name)
        if rounds.any():
            ledger.add(name, "to_client", None, messages=0, nbytes=0, rounds=rounds)
    ledger.round_trips += previous.round_trips


def _preconditioned_row_bound(row_bound, preconditioner, *rows):
    """A user's per-row curvature bound in ``x`` as one in ``u``: ``|S|^T |B| |S|``."""
    d = preconditioner.center.shape[-1]
    return preconditioner.bound_to_u(jnp.broadcast_to(jnp.abs(jnp.asarray(row_bound(*rows))), (d, d)))


def _preconditioned_row_third(row_third, preconditioner, *rows):
    """A user's per-row third-derivative bound in ``x`` as one in ``u``
    (:meth:`~numpyro_fed.infer.zigzag.Preconditioner.third_bound_to_u`)."""
    d = preconditioner.center.shape[-1]
    return preconditioner.third_bound_to_u(jnp.broadcast_to(jnp.abs(jnp.asarray(row_third(*rows))), (d,)))


def _remainder_weights(kappa, valid, *, margin, floor):
    """The :class:`RowWeights` of the rows' remainder bounds ``kappa`` ``(M, n_max, d)`` (mask
    ``valid`` ``(M, n_max)``): times ``margin``, plus ``floor`` times the client's mean (a row
    whose third derivative vanishes where it was looked at, e.g. a logistic row with a zero
    logit, is still drawn)."""
    sizes = jnp.maximum(jnp.sum(valid, axis=1), 1)
    mean = kappa.sum(1, keepdims=True) / sizes[:, None, None]
    kappa = jnp.where(valid[..., None], margin * (kappa + floor * mean), 0.0)
    return importance_weights(jnp.swapaxes(kappa, 1, 2))


def _larger_away(values, factor, axes):
    """``(larger, finite)`` per leading index of ``values`` ``(n, 2, ...)``: the values one unit
    from the reference point (``[:, 1]``) exceed ``factor`` times those around the posterior
    (``[:, 0]``) anywhere, or are not all finite."""
    around, away = np.asarray(values[:, 0], np.float64), np.asarray(values[:, 1], np.float64)
    finite = np.isfinite(away).all(axis=axes)
    larger = (np.where(np.isfinite(away), away, 0.0) > factor * around * (1 + 1e-6) + 1e-12).any(axis=axes)
    return larger, finite


def _warn_local_bound(subsample_size, subject, undefined, ratio, exact):
    """The warning of an automatic subsampling bound that holds near the posterior only:
    ``subject`` (e.g. "the curvature of client 0") is not finite one unit from the reference
    point for ``undefined`` (a list of names), or is up to ``ratio`` times larger there."""
    if undefined:
        how = (f"is not finite one unit from the reference point for {', '.join(undefined)} (the "
               "log-density or its derivatives overflow or are undefined there, e.g. a probability "
               "that rounds to 0 or 1)")
    else:
        how = (f"grows away from the posterior (one unit from the reference point it is up to {ratio:.3g} "
               "times the largest found around the posterior: not bounded globally, e.g. a log link or "
               "a scale parameter)")
    warn_user(
        f"FedZigZag(subsample_size={subsample_size}): {subject} {how}. "
        "The automatic bound holds near the posterior only: proposals whose "
        "estimated rate exceeds it are counted (sample_stats num_violations, check_run), and "
        "each warmup draw with one doubles the bound. For an exact run pass "
        f"bounds={exact} valid everywhere, or subsample_size=None",
        RuntimeWarning)


def _at_x(fn, preconditioner, u):
    """``fn`` of ``x`` as a function of ``u`` (``x = center + scale u``)."""
    return fn(preconditioner.to_x(u))


def _row_curvature_call(grad, layout, row_bound, block, bound_points, probe_points):
    """The clients' ``"row_curvature"`` call (see
    :func:`~numpyro_fed.infer.zigzag.subsample.row_curvature`)."""
    return row_curvature(grad, layout, block, bound_points, probe_points, row_bound)


def _grow_bound(bound_scale, info, i, *, num_warmup, subsample_size, origin):
    """A warmup draw with a bound violation doubles the subsampling's bound (with a warning)."""
    grow = (i < num_warmup) & (info.num_violations > 0)
    # under vmap (vectorized chains) both branches run: the host checks ``grow`` again
    jax.lax.cond(grow, lambda: jax.debug.callback(partial(_report_growth, subsample_size=subsample_size,
                                                          origin=origin), grow, i, bound_scale * 2),
                 lambda: None)
    return jnp.where(grow, bound_scale * 2, bound_scale)


def _report_growth(grow, i, scale, *, subsample_size, origin):
    grow, i, scale = np.asarray(grow), np.asarray(i), np.asarray(scale)
    if not np.any(grow):
        return
    i, scale = i[grow], scale[grow]
    warn_user(
        f"FedZigZag(subsample_size={subsample_size}): warmup draw {int(np.max(i))} had estimated rates "
        f"above their bound; the bound is now {float(np.max(scale)):g} times the clients' (counted in "
        "num_violations; after warmup it stays fixed)", RuntimeWarning, origin)


class FedZigZagState(NamedTuple):
    """NumPyro-facing state of :class:`FedZigZag`.

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


class FedZigZag(FederatedMCMCKernel):
    """Federated Zig-Zag sampler as a NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel`.

    Each client proposes its next switching time from its own term of the potential (see
    :func:`~numpyro_fed.split_potential`); the server takes the earliest. One MCMC sample is
    the position after ``sample_interval`` units of process time, so draws are equally
    spaced in time (stopping on time, not on events, keeps them unbiased).

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`.
    :param float sample_interval: process time between two samples (> 0). ``None``
        (default): adapted during the warmup to the posterior's scale, to the smallest marginal
        posterior sd of the process's coordinates (estimated from the warmup's path; see
        :mod:`~numpyro_fed.infer.zigzag.warmup`), then fixed, so the draws after the warmup
        are those of an exact Zig-Zag process at equal times; each chain adapts its own (read it
        with ``extra_fields=("adapt.interval",)``). Without warmup, 1.0. A value given is
        used as it is.
    :param control_variates: ``True`` re-splits the clients' terms around a reference
        point (the MAP, found at initialization from the aggregated gradient; with a
        federation, from the clients' replies) so that the
        sum is unchanged but spurious switches vanish; ``None`` (default): on when M > 1.
        When the posterior has no mode (a funnel) the reference is re-centered during warmup
        on the warmup trajectory; at the end of warmup the control variates are kept only if
        they lower the switching rates at the last warmup positions, and a warmup draw that
        stalls with them (``max_proposals`` proposals, no switch) turns them off, with a
        warning (see :attr:`mode_search` and the user guide).
        ``"second_order"`` also matches the clients' Hessians at the reference point (one
        more aggregation round, in which each client sends its ``d x d`` Hessian there): the
        re-split terms then agree to second order, which removes the spurious switches that
        remain when clients hold few rows for many coordinates (their curvatures differ).
        It needs the automatic bounds (``"grid"`` or ``"affine"``), or ``subsample_size``.
        ``"first_order"``: on, first order (what ``True`` means, except with
        ``subsample_size`` in process, where ``True`` and ``None`` mean second order).
    :param str prior: ``"server"`` (the prior proposes on its own), ``"clients"``
        (shared evenly among the clients' terms), the two options of Remark 3.2, or
        ``"redistribute"`` (Appendix D, Algorithm 4: random shares of the prior, redrawn at
        ``redistribution_rate``).
    :param float redistribution_rate: rate of the prior's redistribution (> 0 with
        ``prior="redistribute"``; the paper uses 0.1).
    :param float excess_rate: refreshment rate ``rho`` added to every proposer (>= 0).
    :param str bounds: ``"grid"`` (default): automatic bounds on a grid along the
        trajectory, for any differentiable potential; ``"affine"``: exact inversion of the
        rate's linear extrapolation ``max(0, a + b t)``, exact (no rejections) when the
        potential is quadratic, e.g. a Gaussian target; used elsewhere, its violations are
        counted and reported. Or bounds the user derived (Appendices A and F of the paper):
        a :class:`GradientBound` (constant rates: no gradient evaluated to propose) or a
        :class:`HessianBound` (rates affine in time; with control variates, no gradient
        evaluated to propose either), with one row per client, computed by each client
        from its own data.
    :param int grid_size: grid points of the automatic bound (>= 2).
    :param float safety_factor: multiplies the automatic bounds (>= 1).
    :param float initial_horizon: starting horizon of the bounds (> 0).
    :param float dp_sensitivity: ``K > 1``, a bound on how much one row of a client can
        change that client's switching intensity (e.g. the bound on the covariates' norm in
        logistic regression, Example 5.2). Setting it turns on the privacy guarantee of
        Theorem 5.1, reported as :attr:`privacy` and in InferenceData ``attrs``.
    :param float dp_epsilon: target epsilon *per switching time*; with ``dp_sensitivity``
        and ``dp_delta``, ``excess_rate`` is chosen by (7) unless given.
    :param float dp_delta: delta per switching time, in (0, 1).
    :param int skeleton_size: switches recorded per sample for plots (0: none); read them
        with :meth:`skeleton`.
    :param bool full_covariance: integrate the full ``x x^T`` along the path (else only its
        diagonal) for :meth:`trajectory_moments`.
    :param preconditioner: the process moves in ``u`` with ``x = center + scale u`` (``x``
        the flat unconstrained latent vector), the Zig-Zag counterpart of NUTS's mass
        matrix: ``None`` (default); ``"laplace"``: ``scale`` the Cholesky factor of the
        inverse Hessian at the mode (found as for the control variates; in a federation one
        round in which each client sends its Hessian there); ``"diagonal"``: its diagonal
        only; or a user's ``scale``, ``(d,)`` or an invertible ``(d, d)``. Correlated or
        badly scaled posteriors mix many times faster; the draws, trajectory moments and
        skeleton are reported in ``x``.
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: NumPyro init strategy: where the chain starts, or, with control
        variates or a computed preconditioner, where the search for the mode starts (the
        chains then start at the mode, if there is one). ``init_params`` given to ``MCMC.run`` take
        precedence; with ``num_chains > 1`` and ``chain_method="vectorized"`` the chains
        run under one ``vmap`` and share the mode, the preconditioner and the split.

    :param federation: ``None`` (default): every client in this process, vectorized, and the
        server thins the proposals with the clients' bounds: the fastest choice in one
        process. Or a :class:`~numpyro_fed.federation.Federation`
        (:class:`~numpyro_fed.federation.InProcess`, :class:`~numpyro_fed.RayFederation`):
        Algorithm 2 as messages (:mod:`~numpyro_fed.infer.zigzag.federated`): in each round
        every client finds its own next switching time on its own rows (thinning against its
        exact rate, locally) and sends that time and the coordinate; the server takes the
        earliest. One round per switch; the same posterior as ``None``, and the same draws
        bit for bit on every backend for the same key. Each draw's message ledger is in
        ``sample_stats`` and :meth:`message_ledger`; on an engine backend the draws are kept
        on the host as they complete (:attr:`last_completed_state`, :attr:`completed_draws`)
        so that a run stopped by a :class:`~numpyro_fed.federation.ClientError` can resume.
        Run ``MCMC.run`` under ``with federation.guard():`` to get that error as itself.
        The set-up goes through the federation too (:mod:`~numpyro_fed.infer.zigzag.setup`):
        the mode search, the gradients at the reference point and any Hessians are the
        clients' replies to ``"value_and_grad"`` and ``"hessian"`` calls, counted in
        :meth:`message_ledger`. **Deployment**: given a federation with ``loader=`` (e.g.
        ``nf.RayFederation(loader=load, num_clients=M)``) run ``MCMC.run(rng_key)`` without
        data arguments: each client loads its own rows where it lives and the driver never
        holds one. See the user guide, "Run across machines".

    :param bool private_randomness: with a federation, each client draws its proposals from a
        key the server does not know: the key the server sends in a round is folded with a
        seed the client drew from its operating system's entropy when it loaded its rows (the
        guarantee of Theorem 5.1 assumes the server does not know a client's randomness).
        The cost is reproducibility: the same ``rng_key`` no longer gives the same draws, and
        backends no longer agree bit for bit (only in distribution). Meaningful in deployment
        (``loader=``), where the seed is drawn on the client's worker; in simulation the
        driver builds the blocks and draws the seeds. Default ``False``: the server derives
        every client's key from ``rng_key``.

    :param int subsample_size: ``b >= 1``: each client checks a proposal against an unbiased
        estimate of its rate from ``b`` of its rows drawn at random around the control
        variates' reference point (Bierkens, Fearnhead & Roberts 2019;
        :mod:`~numpyro_fed.infer.zigzag.subsample`), thinned against a bound on its rows'
        curvature, so a proposal costs ``2 b`` row gradients whatever the client's size.
        Without a ``federation`` (clients vectorized in this process) the estimate uses
        second-order control variates: the client's Taylor term around the reference is kept
        whole (the rate's Gaussian-approximation part, exact) and only the rows' remainders
        after it are sampled, each row drawn in proportion to its remainder bound (a bound on
        its third derivative) along the proposal's coordinate; that bound shrinks with the
        data, so at large ``N`` almost every proposal is a switch whatever the dimension.
        ``control_variates="first_order"`` keeps the first-order estimate, rows drawn in
        proportion to their curvature. Through a federation the estimate is first order and
        the rows are drawn uniformly.
        The bound is automatic (each client's, from its own rows, once at set-up; a model
        whose curvature or third derivative grows away from the posterior is warned, its
        violations counted, and a violation during warmup doubles the bound) or a
        :class:`RowHessianBound` given as ``bounds`` (with ``third=`` for second order).
        Needs a mode and control variates (on whatever ``M``); with a ``preconditioner``
        (in process) everything is in ``u``; refused with row-local latents, with a privacy
        guarantee and with a preconditioner or second order through a federation. ``None``
        (default): every rate from all the rows. ``sample_stats`` then counts the row
        gradients (``grad_row_evals``; :attr:`rows_per_gradient`: ``2 b`` rows per estimate,
        the second-order one's forward pass at ``x*`` included).

    A sample that makes ``max_proposals`` proposals (at least 50) without one switch stops
    its chain: the remaining draws repeat its last position, are marked ``hit_event_cap``,
    and a warning names the remedies. After ``init``, :attr:`mode_search` (a
    :class:`ModeSearch`) says whether a mode was found.

    The privacy guarantee covers **each switching time a client sends, one message at a
    time**; it is not composed over the many messages of a run. Control variates need set-up
    rounds of gradients (the mode search; through the federation when there is one) that the
    theorem does not cover, so they are off when a guarantee is asked for (and asking for
    both is an error).

    **Example**

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
    ...     with nf.federated_plate("data", y.shape[0], clients=4):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> y = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (100,))
    >>> mcmc = MCMC(nf.FedZigZag(model, sample_interval=0.2), num_warmup=100, num_samples=2000,
    ...             progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(1), y)
    >>> abs(float(mcmc.get_samples()["mu"].mean() - y.sum() / (100 + 0.01))) < 0.05
    True

    The same through a federation (here in process; ``nf.RayFederation()`` for workers):
    one round of messages per switch.

    >>> from numpyro_fed.federation import InProcess
    >>> sampler = nf.FedZigZag(model, sample_interval=0.2, federation=InProcess())
    >>> mcmc = MCMC(sampler, num_warmup=50, num_samples=200, progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(1), y)
    >>> fields = mcmc.get_extra_fields()
    >>> bool(fields["info.rounds"].sum() >= fields["info.num_events"].sum())
    True
    >>> sampler.message_ledger(mcmc)["bytes_from_client"].shape  # one entry per client
    (4,)

    Subsampling: each check reads one row of the winning client (here 25 rows each).

    >>> sampler = nf.FedZigZag(model, sample_interval=0.2, subsample_size=1)
    >>> mcmc = MCMC(sampler, num_warmup=50, num_samples=500, progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(1), y)
    >>> abs(float(mcmc.get_samples()["mu"].mean() - y.sum() / (100 + 0.01))) < 0.1
    True
    >>> sampler.rows_per_gradient.tolist(), int(mcmc.get_extra_fields()["info.num_violations"].sum())
    ([2, 2, 2, 2], 0)

    Deployment: each client loads its own rows (here in this process; with
    ``nf.RayFederation(loader=load, num_clients=4)`` on its worker), and ``run`` takes no data.

    >>> def load(m):
    ...     return (y[25 * m:25 * (m + 1)],)
    >>> sampler = nf.FedZigZag(model, sample_interval=0.2, federation=InProcess(loader=load, num_clients=4))
    >>> mcmc = MCMC(sampler, num_warmup=50, num_samples=200, progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(1))
    >>> sampler.federated_potential.deployed, mcmc.get_samples()["mu"].shape
    (True, (200,))
    """

    #: the counts of :class:`~numpyro_fed.infer.zigzag.SampleInfo` reported in ``sample_stats``
    info_names = DIAGNOSTICS

    def __init__(
        self,
        model,
        *,
        sample_interval: float | None = None,
        control_variates: bool | str | None = None,
        prior: str = "server",
        redistribution_rate: float = 0.1,
        excess_rate: float = 0.0,
        bounds="grid",
        grid_size: int = 2,
        safety_factor: float = 1.0,
        initial_horizon: float = 0.1,
        max_proposals: int = 1_000_000,
        partition=None,
        init_strategy=init_to_uniform,
        dp_sensitivity: float | None = None,
        dp_epsilon: float | None = None,
        dp_delta: float | None = None,
        skeleton_size: int = 0,
        full_covariance: bool = False,
        preconditioner=None,
        federation=None,
        private_randomness: bool = False,
        subsample_size: int | None = None,
    ):
        super().__init__(model, partition=partition, init_strategy=init_strategy)
        if federation is not None and not isinstance(federation, Federation):
            raise TypeError(f"federation must be a Federation (e.g. nf.RayFederation()) or None, "
                            f"got {type(federation).__name__}")
        self.federation = federation
        if private_randomness and federation is None:
            raise ValueError("private_randomness=True needs a federation (the clients draw their own "
                             "randomness when they answer rounds; federation=None has no rounds)")
        self.private_randomness = bool(private_randomness)
        self.message_sizes = {}
        #: with an engine backend: the state after the last completed draw and every completed
        #: draw's ``z``, kept on the host (a worker can fail mid-run; see the user guide)
        self.last_completed_state = None
        self.completed_draws = []
        self._program_key = None
        self._program = None
        self._program_data = None
        #: with a federation: the set-up calls of the last ``init``
        #: (a :class:`~numpyro_fed.infer.zigzag.setup.SetupTally`)
        self.setup_tally = None
        if isinstance(preconditioner, str) and preconditioner not in ("laplace", "diagonal"):
            raise ValueError(f"preconditioner must be None, 'laplace', 'diagonal' or an array, got {preconditioner!r}")
        self.preconditioner = preconditioner
        self.preconditioning = None
        self.skeleton_size = check_int(skeleton_size, "skeleton_size", minimum=0)
        self.full_covariance = bool(full_covariance)
        self.sample_interval = None if sample_interval is None else check_positive(sample_interval, "sample_interval")
        if excess_rate is None or check_real(excess_rate, "excess_rate") < 0:
            raise ValueError(f"excess_rate must be >= 0, got {excess_rate}")
        self.excess_rate = float(excess_rate)
        self.subsample_size = None if subsample_size is None else check_int(subsample_size, "subsample_size", minimum=1)
        if self.subsample_size is None:
            if isinstance(bounds, RowHessianBound):
                raise ValueError("bounds=RowHessianBound(...) bounds each row's curvature for subsampling: "
                                 "pass subsample_size (e.g. subsample_size=1) with it")
            bound_kind(bounds)
        else:
            if not (isinstance(bounds, RowHessianBound) or bounds == "grid"):
                raise ValueError(
                    f"subsample_size={self.subsample_size} thins against bounds on every row's curvature: "
                    "leave bounds at its default (automatic, computed by each client from its rows) or "
                    f"pass a RowHessianBound, not {bounds!r}")
            if isinstance(bounds, RowHessianBound) and not callable(bounds.rows):
                raise TypeError(f"RowHessianBound.rows must be a function of one row's model arguments, "
                                f"got {type(bounds.rows).__name__}")
            if control_variates is False:
                raise ValueError(
                    f"subsample_size={self.subsample_size} estimates each rate around the control "
                    "variates' reference point: control_variates=False is not supported with it "
                    "(leave it at None, True or 'second_order')")
            if control_variates == "second_order" and federation is not None:
                raise ValueError(
                    f"subsample_size={self.subsample_size} with control_variates='second_order' is "
                    "supported in process (federation=None), not through a federation (its batches are "
                    "drawn uniformly, around first-order control variates): pass control_variates=None")
            user_third = not isinstance(bounds, RowHessianBound) or bounds.third is not None
            if control_variates == "second_order" and not user_third:
                raise ValueError(
                    "control_variates='second_order' with subsampling bounds the rows' remainders after "
                    "their Taylor term: a RowHessianBound needs third=... for it (or pass "
                    "control_variates=None for first order against its curvature bound)")
            if isinstance(bounds, RowHessianBound) and bounds.third is not None and not callable(bounds.third):
                raise TypeError(f"RowHessianBound.third must be a function of one row's model arguments, "
                                f"got {type(bounds.third).__name__}")
            if preconditioner is not None and federation is not None:
                raise ValueError(f"subsample_size={self.subsample_size} with preconditioner={preconditioner!r} "
                                 "is supported in process (federation=None), not through a federation: "
                                 "pass preconditioner=None or federation=None")
            if dp_sensitivity is not None or dp_epsilon is not None or dp_delta is not None:
                raise ValueError(
                    f"subsample_size={self.subsample_size} with a privacy guarantee (dp_sensitivity/"
                    "dp_epsilon/dp_delta): Theorem 5.1 covers switching times thinned against a "
                    "client's exact rate with refreshment; a rate estimated from random rows around "
                    "a reference point (and the set-up rounds it needs) is not covered. Pass "
                    "subsample_size=None for the guarantee")
        self.bounds = bounds
        self.grid_size = check_int(grid_size, "grid_size", minimum=2)
        self.safety_factor = check_real(safety_factor, "safety_factor")
        if self.safety_factor < 1:
            raise ValueError(f"safety_factor must be >= 1, got {safety_factor}")
        self.initial_horizon = check_positive(initial_horizon, "initial_horizon")
        self.max_proposals = check_int(max_proposals, "max_proposals", minimum=1)
        if prior not in PRIOR_MODES:
            raise ValueError(f"prior must be one of {PRIOR_MODES}, got {prior!r}")
        self.prior = prior
        self.redistribution_rate = (check_positive(redistribution_rate, "redistribution_rate")
                                    if prior == "redistribute" else redistribution_rate)
        if not (control_variates is None or isinstance(control_variates, (bool, np.bool_))
                or control_variates in ("first_order", "second_order")):
            raise ValueError(
                f"control_variates must be None, True, False, 'first_order' or 'second_order', got "
                f"{control_variates!r}"
            )
        if control_variates == "second_order" and not isinstance(bounds, str) and self.subsample_size is None:
            raise ValueError(
                "control_variates='second_order' needs the automatic bounds ('grid' or 'affine'): "
                f"a {type(bounds).__name__} does not bound the linear part of the shift"
            )
        self.control_variates = control_variates
        self.privacy = self._privacy_guarantee(dp_sensitivity, dp_epsilon, dp_delta)
        self.reference_point = None
        self.mode_search = None
        #: row gradients one gradient evaluation of each client costs (``(M,)``, after
        #: ``init``): its rows, or with ``subsample_size`` the rows one estimate evaluates
        self.rows_per_gradient = None
        #: with ``subsample_size``, after ``init``: the clients' curvature bounds, laid out per
        #: proposer (through a federation a :class:`HessianBound`; in process a
        #: :class:`~numpyro_fed.infer.zigzag.bounds.SampledRowBound`, whose ``sup`` are the
        #: importance-sampled rows' summed curvatures), and whether the automatic bound
        #: found a curvature that grows away from the posterior (violations possible)
        self.subsample_bounds = None
        self.unbounded_curvature = False

    def _privacy_guarantee(self, sensitivity, epsilon, delta):
        if sensitivity is None:
            if epsilon is not None or delta is not None:
                raise ValueError("dp_epsilon/dp_delta need dp_sensitivity (the bound K of Theorem 5.1)")
            return None
        if delta is None:
            raise ValueError("dp_sensitivity needs dp_delta")
        if self.control_variates:
            raise ValueError(
                f"control_variates={self.control_variates!r} with a privacy guarantee: the control "
                "variates' aggregation round is not covered by Theorem 5.1"
            )
        self.control_variates = False
        if isinstance(self.preconditioner, str):
            raise ValueError(
                f"preconditioner={self.preconditioner!r} with a privacy guarantee: the round of "
                "Hessians it needs is not covered by Theorem 5.1 (pass a fixed scale; K must then "
                "bound the change of the preconditioned intensities)"
            )
        self.excess_rate, guarantee = switching_time_guarantee(sensitivity, self.excess_rate, delta,
                                                               epsilon=epsilon)
        return guarantee

    @property
    def default_fields(self):
        fields = DIAGNOSTICS + TRAJECTORY + (SKELETON if self.skeleton_size else ())
        return ("z",) + tuple("info." + name for name in fields)

    def diagnose(self, mcmc, *, min_ess: float = 50.0) -> RunCheck:
        """What went wrong in a run, if anything (:meth:`check_run` warns, or raises with
        ``strict``; :func:`~numpyro_fed.to_inference_data` calls it): proposals whose exact
        rate exceeded its bound (each one biases the chain slightly), samples cut short by
        ``max_proposals``, and draws too few to summarize: a site's element with fewer than
        ``min_ess`` effective draws (NumPyro's estimator over the chains), whose mean then
        carries a Monte Carlo error above ``1 / sqrt(min_ess)`` (0.14) of its sd.

        Its ``result`` (what :meth:`check_run` returns) is ``(num_violations, num_proposals,
        num_capped_samples)``.
        """
        problems = few_effective_draws(mcmc.get_samples(group_by_chain=True), min_ess,
                                       preconditioned=self.preconditioner is not None)
        interval = self.sample_interval
        state = getattr(mcmc, "last_state", None)
        if interval is None and state is not None and hasattr(state, "adapt"):
            interval = float(f"{float(np.max(jax.device_get(state.adapt.interval))):.3g}")
        violations, proposals, capped, rates = rate_problems(
            mcmc.get_extra_fields(), kind=self._bound_kind(), max_proposals=self.max_proposals,
            sample_interval=interval)
        return RunCheck(problems + rates, (violations, proposals, capped))

    def _bound_kind(self):
        return "subsample" if self.subsample_size is not None else bound_kind(self.bounds)

    def trajectory_moments(self, mcmc):
        """Mean and covariance (or variance) of the whole sampled path, computed exactly
        from the piecewise-linear trajectory rather than from the draws; on the flat
        unconstrained space (see :meth:`FederatedPotential.unravel`).

        :return: ``{"mean": (d,), "cov": (d, d)}`` with ``full_covariance``, else
            ``{"mean": (d,), "var": (d,)}``.
        """
        return trajectory_moments_of(mcmc.get_extra_fields(), self.preconditioning)

    def skeleton(self, mcmc, *, chain: int = 0):
        """The recorded switches of one chain's sampling phase: ``(times, positions,
        velocities)`` with times counted from the first sample's start, positions flat
        unconstrained. The path is the straight line between consecutive points."""
        if not self.skeleton_size:
            raise ValueError("no skeleton was recorded: pass skeleton_size > 0 to FedZigZag")
        return skeleton_of(mcmc.get_extra_fields(group_by_chain=True), chain, self.skeleton_size,
                           self.preconditioning)

    def sample_stats(self, extra_fields):
        """Diagnostics by name from ``MCMC.get_extra_fields(group_by_chain=True)``:
        ``{name: (array, dims)}``; per-client counts get a ``client`` dim, the prior's
        proposer (when it is the server's) its own entries. With a ``federation``, the message
        ledger of every draw: ``messages_to_client``, ``bytes_to_client``,
        ``messages_from_client``, ``bytes_from_client`` (``client`` dim; see
        :meth:`message_ledger`). ``grad_row_evals`` (and ``grad_row_evals_by_client``): the
        row gradients the clients evaluated in each draw, their gradient evaluations times
        :attr:`rows_per_gradient` (all their rows, or with ``subsample_size`` the batch at
        the point and at the reference)."""
        num_clients = self.federated_potential.num_clients
        stats = per_client_stats(extra_fields, num_clients, self.prior == "server")
        evals = extra_fields.get("info.grad_evals_by_proposer")
        if evals is not None and self.rows_per_gradient is not None:
            rows = np.asarray(jax.device_get(evals))[..., :num_clients].astype(np.int64) * self.rows_per_gradient
            stats["grad_row_evals_by_client"] = (rows, ["client"])
            stats["grad_row_evals"] = (rows.sum(-1), [])
        if self.federation is not None and "info.rounds" in extra_fields:
            stats.update({name: (value, ["client"]) for name, value in
                          self._ledger_of(np.asarray(jax.device_get(extra_fields["info.rounds"]))).items()})
        return stats

    def _ledger_of(self, rounds):
        num_clients = self.federated_potential.num_clients
        messages = np.repeat(rounds[..., None].astype(np.int64), num_clients, axis=-1)
        return {
            "messages_to_client": messages,
            "bytes_to_client": messages * self.message_sizes["to_client"],
            "messages_from_client": messages,
            "bytes_from_client": messages * self.message_sizes["from_client"],
        }

    def message_ledger(self, mcmc) -> dict:
        """What crossed the wire in ``mcmc``'s run, per client: ``{name: (M,) int array}``
        with the names of :meth:`MessageLedger.summary
        <numpyro_fed.federation.MessageLedger.summary>`: totals (``messages_to_client``,
        ``bytes_to_client``, ``messages_from_client``, ``bytes_from_client``, ``rounds``) and
        the same per call, prefixed ``"propose/"``, ``"value_and_grad/"``, ``"hessian/"``.

        ``propose``: in a round the server sends every client the current point and its
        settings, and every client answers with one
        :class:`~numpyro_fed.infer.zigzag.federated.Proposal` (its first switching time and
        coordinate; plus its :class:`~numpyro_fed.infer.zigzag.federated.ClientCounts` when no
        privacy guarantee is asked for); the rounds of the warmup's draws are included when
        ``mcmc`` recorded them (``collect_warmup=True``). The set-up calls
        (:mod:`~numpyro_fed.infer.zigzag.setup`: the mode search, the control variates'
        reference, a Laplace preconditioner, the warmup's re-centering and comparison) are
        always included: ``d`` numbers down per message, ``d + 1`` up for
        ``"value_and_grad"``, ``d^2`` for ``"hessian"``."""
        if self.federation is None:
            raise ValueError("message_ledger: this FedZigZag has no federation (federation=None: "
                             "the clients are vectorized in this process and send no messages)")
        rounds = np.asarray(jax.device_get(mcmc.get_extra_fields()["info.rounds"]))
        ledger = {"propose/" + name: value.reshape(-1, value.shape[-1]).sum(0)
                  for name, value in self._ledger_of(rounds).items()}
        ledger["propose/rounds"] = ledger["propose/messages_from_client"].copy()
        if self.setup_tally is not None:
            warmup = {}
            state = getattr(mcmc, "last_state", None)
            if state is not None and hasattr(state, "adapt"):
                calls = np.asarray(jax.device_get(state.adapt.client_calls)).reshape(-1, 2).sum(0)
                warmup = {"value_and_grad": int(calls[0]), "hessian": int(calls[1])}
            ledger.update(self.setup_tally.summary(self.federated_potential.num_clients, warmup))
        totals = {}
        for key, value in ledger.items():
            name = key.split("/", 1)[1]
            totals[name] = totals.get(name, 0) + value
        return {**totals, **ledger}

    def _keep_completed(self, state):
        """Host side: keeps the state after a completed draw (and its draw)."""
        state = jax.tree.map(np.asarray, state)  # a leading chain axis under vectorized chains
        self.last_completed_state = state
        self.completed_draws.append(state.z)
        return np.zeros(np.shape(state.i), np.int32)

    def get_diagnostics_str(self, state):
        return "{} events, {} proposals".format(int(state.info.num_events), int(state.info.num_proposals))

    # -- set-up: the mode, the preconditioner, the kernel ------------------------------------

    def _subsample_bounds(self, potential, layout, reference, flat_potential, hessian, row_grad, num_proposers,
                          order=1):
        """The clients' bounds on their rate estimates (a :class:`HessianBound` laid out per
        proposer), each client's row from its own rows (in a federation: one
        ``"row_curvature"`` call), the prior's on the server; warns when the curvature grows
        away from the posterior (the automatic bound is then local).

        With a preconditioner (in process) everything is in ``u``: ``point`` is the reference
        there, ``row_grad`` a row's gradient in ``u`` (:func:`preconditioned_row_grad`), and the
        curvatures are those of the potential of ``u``."""
        point = reference.point
        d, dtype = point.shape[0], point.dtype
        pre = self.preconditioning
        x_point = pre.to_x(point) if pre is not None else point
        if order == 2:  # the second-order control variates hold it, in the process's space
            total = np.asarray(reference.term_hessians.sum(0) + reference.prior_hessian, np.float64)
        else:
            if hessian is not None:  # through the federation: one "hessian" call
                total = hessian(x_point)
                self.setup_tally.add("hessian")
            else:
                total = jax.jit(jax.hessian(flat_potential))(x_point)
            total = np.asarray(total, np.float64)
            if pre is not None:
                scale = np.asarray(pre.matrix(), np.float64)
                total = scale.T @ total @ scale
        try:
            variances = np.diag(np.linalg.inv(total))
        except np.linalg.LinAlgError:
            variances = np.full(d, np.nan)
        variances = np.where(np.isfinite(variances) & (variances > 0), variances,
                             1.0 / np.maximum(np.abs(np.diag(total)), 1e-12))
        sd = np.sqrt(variances)
        # the probe points' signs are part of the bound's definition, not of the chain's randomness:
        # drawn from a fixed key, so a model gets the same bound whatever the run's key and on every
        # backend (the clients receive the points), and no generator outside JAX's keys is used
        signs = np.asarray(jax.random.rademacher(jax.random.PRNGKey(0), (4, d)), np.float64)
        center = np.asarray(point, np.float64)
        # the origin of x (where a GLM's curvature peaks) and, one unit of x away from the
        # reference, the points where a curvature that grows shows itself
        origin = np.zeros((1, d)) if pre is None else np.asarray(pre.to_u(jnp.zeros((1, d), dtype)), np.float64)
        bound_points = jnp.asarray(np.concatenate([center[None], origin, center + 2.5 * sd * signs]), dtype)
        probe_points = jnp.asarray(center + signs if pre is None else pre.to_u(x_point + jnp.asarray(signs, dtype)),
                                   dtype)
        row_bound = self.bounds.rows if isinstance(self.bounds, RowHessianBound) else None
        if row_bound is not None and pre is not None:  # |S^T H S| <= |S|^T |H| |S| entrywise
            row_bound = partial(_preconditioned_row_bound, row_bound, pre)
        if order == 2:
            return self._second_order_bounds(potential, layout, row_grad, num_proposers, bound_points,
                                             probe_points, horizon=float(np.min(sd)))
        weights = None
        if self.federation is not None:
            curvature = self.federation.map("row_curvature", bound_points, probe_points)
            self.setup_tally.add("row_curvature")
        else:  # in process: every row's weight too, for the importance sampling
            curvature, level, weights = jax.jit(jax.vmap(partial(
                row_weights, row_grad, layout, bound_points=bound_points, probe_points=probe_points,
                row_bound=row_bound)))(potential.client_data)
            weights = jnp.swapaxes(weights, 1, 2)  # (M, d, n_max)
            level = np.asarray(level, np.float64)[:, 0]
        curvature = np.asarray(curvature, np.float64)  # (M, 2, d, d)
        prior = self._prior_curvature(potential, bound_points, probe_points)
        user_prior = isinstance(self.bounds, RowHessianBound) and self.bounds.prior is not None
        if not (np.isfinite(curvature[:, 0]).all() and np.isfinite(prior[0]).all()):
            raise ValueError(f"FedZigZag(subsample_size={self.subsample_size}): the curvature bound is not "
                             "finite (a row's Hessian is inf or nan near the posterior: at the reference point, "
                             "the origin or 2.5 posterior sds around the reference); pass subsample_size=None")
        # one unit away: a curvature larger there, or not finite (a probability that rounds to
        # 0 or 1, a log-density undefined there), bounds the rows only near the posterior
        slack = lambda b: b * (1 + 1e-6) + 1e-12  # noqa: E731
        finite_part = lambda a: np.where(np.isfinite(a), a, 0.0)  # noqa: E731
        finite = np.isfinite(curvature[:, 1]).all(axis=(-1, -2))
        larger = (finite_part(curvature[:, 1]) > slack(curvature[:, 0])).any(axis=(-1, -2))
        grows = [f"client {m}" for m in np.flatnonzero(larger | ~finite)]
        prior_finite = bool(np.isfinite(prior[1]).all())
        if not user_prior and (not prior_finite or (finite_part(prior[1]) > slack(prior[0])).any()):
            grows.append("the prior")
        self.unbounded_curvature = bool(grows)
        if grows:
            undefined = [f"client {m}" for m in np.flatnonzero(~finite)]
            if not (user_prior or prior_finite):
                undefined.append("the prior")
            ratio = max(float(np.max(curvature[:, 1] / np.maximum(curvature[:, 0], 1e-300))),
                        0.0 if user_prior else float(np.max(prior[1] / np.maximum(prior[0], 1e-300))))
            _warn_local_bound(self.subsample_size, f"the curvature of {', '.join(grows)}", undefined, ratio,
                              "RowHessianBound(...)")
        margin = 1.0 if row_bound is not None and not layout.client_terms else AUTOMATIC_MARGIN
        prior_bound = np.asarray(self.bounds.prior, np.float64) if user_prior else AUTOMATIC_MARGIN * prior[0]
        if user_prior and pre is not None:
            prior_bound = pre.bound_to_u(np.abs(prior_bound))
        if weights is None:  # uniform batches: the largest row's curvature n_m times
            bound = HessianBound(np.maximum(margin * curvature[:, 0], 0.0), np.maximum(prior_bound, 0.0))
            return per_proposer_bound(bound, potential.num_clients, num_proposers, d, dtype), None
        # rows drawn in proportion to their curvature: the level terms' Hessian bound, and the
        # rows' sum of curvatures against the largest distance to the reference
        weights = jax.jit(importance_weights)(weights)
        level_bound = per_proposer_bound(HessianBound(np.maximum(AUTOMATIC_MARGIN * level, 0.0),
                                                      np.maximum(prior_bound, 0.0)),
                                         potential.num_clients, num_proposers, d, dtype)
        sup = margin * np.asarray(weights.sup, np.float64)
        if num_proposers > potential.num_clients:
            sup = np.concatenate([sup, np.zeros((1, d))])
        if not np.isfinite(sup).all():
            raise ValueError(f"FedZigZag(subsample_size={self.subsample_size}): the curvature bound is not "
                             "finite (a row's Hessian is inf or nan near the posterior); pass subsample_size=None")
        bound = SampledRowBound(level_bound.clients, level_bound.prior, jnp.asarray(sup, dtype))
        return bound, weights

    def _subsample_order(self) -> int:
        """The control variates' order with ``subsample_size``: second in process (unless a
        :class:`RowHessianBound` without ``third`` is given), first through a federation."""
        if self.control_variates in ("first_order", "second_order"):
            return 1 if self.control_variates == "first_order" else 2
        if self.federation is not None or (isinstance(self.bounds, RowHessianBound) and self.bounds.third is None):
            return 1
        return 2

    def _prior_curvature(self, potential, bound_points, probe_points):
        """``(2, d, d)``: the prior's largest ``|d_i d_k U_0|`` over ``bound_points`` and over
        ``probe_points`` (in ``u`` with a preconditioner), on the server."""
        pre = self.preconditioning
        prior_potential = potential.flat().prior_potential
        if pre is not None:
            prior_potential = partial(_at_x, prior_potential, pre)
        prior_hessians = np.abs(np.asarray(jax.jit(jax.vmap(jax.hessian(prior_potential)))(
            jnp.concatenate([bound_points, probe_points])), np.float64))
        num_bound = bound_points.shape[0]
        return np.stack([prior_hessians[:num_bound].max(0), prior_hessians[num_bound:].max(0)])

    def _second_order_bounds(self, potential, layout, row_grad, num_proposers, bound_points, probe_points,
                             horizon):
        """In process, second order: ``(SampledRowBound, RowWeights)``: the rows drawn in
        proportion to their remainder bounds (:func:`third_weights`), and the bound of the
        exactly computed terms' Hessian variation (twice their largest curvature: the prior's,
        the client-level terms'). Warns when the third derivative grows away from the
        posterior (the automatic bound is then local)."""
        d, dtype = bound_points.shape[-1], bound_points.dtype
        row_third = self.bounds.third if isinstance(self.bounds, RowHessianBound) else None
        pre = self.preconditioning
        if row_third is not None and pre is not None:
            row_third = partial(_preconditioned_row_third, row_third, pre)
        level, kappa, spread = jax.jit(jax.vmap(partial(
            third_weights, row_grad, layout, bound_points=bound_points, probe_points=probe_points,
            row_third=row_third)))(potential.client_data)
        level, spread = np.asarray(level, np.float64), np.asarray(spread, np.float64)
        prior = self._prior_curvature(potential, bound_points, probe_points)
        user_prior = isinstance(self.bounds, RowHessianBound) and self.bounds.prior is not None
        if not (np.isfinite(np.asarray(kappa)).all() and np.isfinite(level[:, 0]).all()
                and np.isfinite(prior[0]).all()):
            raise ValueError(f"FedZigZag(subsample_size={self.subsample_size}): the remainder bound is not "
                             "finite (a row's third derivative is inf or nan near the posterior); pass "
                             "subsample_size=None")
        # one unit away: a third derivative much larger there (a log link), a curvature of the
        # exactly computed terms larger there, or either not finite, bounds them near the
        # posterior only
        rows_larger, rows_finite = _larger_away(spread, THIRD_GROWTH, axes=-1)
        if row_third is not None:
            rows_larger, rows_finite = np.zeros_like(rows_larger), np.ones_like(rows_finite)
        level_larger, level_finite = _larger_away(level, 1.0, axes=(-1, -2))
        prior_larger, prior_finite = _larger_away(prior[None], 1.0, axes=(-1, -2))
        if user_prior:
            prior_larger, prior_finite = np.zeros(1, bool), np.ones(1, bool)
        names = [f"client {m}" for m in range(potential.num_clients)] + ["the prior"]
        rows_grow = [names[m] for m in np.flatnonzero(rows_larger | ~rows_finite)]
        exact_grow = [names[k] for k in np.flatnonzero(np.concatenate([level_larger | ~level_finite,
                                                                        prior_larger | ~prior_finite]))]
        finite = np.concatenate([rows_finite & level_finite, prior_finite])
        self.unbounded_curvature = bool(rows_grow or exact_grow)
        if self.unbounded_curvature:
            subject = " and ".join(
                ([f"the rows' third derivative of {', '.join(rows_grow)}"] if rows_grow else [])
                + ([f"the curvature of {', '.join(exact_grow)}"] if exact_grow else []))
            ratios = [level[:, 1] / np.maximum(level[:, 0], 1e-300)]
            if row_third is None:
                ratios.append(spread[:, 1] / np.maximum(spread[:, 0], 1e-300))
            if not user_prior:
                ratios.append(prior[1] / np.maximum(prior[0], 1e-300))
            ratio = max(float(np.max(np.where(np.isfinite(r), r, 0.0))) for r in ratios)
            _warn_local_bound(self.subsample_size, subject, [names[k] for k in np.flatnonzero(~finite)], ratio,
                              "RowHessianBound(..., third=...)")
        margin = 1.0 if row_third is not None else AUTOMATIC_MARGIN
        floor = 0.0 if row_third is not None else THIRD_FLOOR
        weights = jax.jit(partial(_remainder_weights, margin=margin, floor=floor))(
            kappa, potential.client_data["valid"][layout.plate])
        prior_bound = np.asarray(self.bounds.prior, np.float64) if user_prior else AUTOMATIC_MARGIN * prior[0]
        if user_prior and pre is not None:
            prior_bound = pre.bound_to_u(np.abs(prior_bound))
        # |H(y) - H(x*)| <= 2 max |H| for the terms computed exactly
        variation = HessianBound(2 * AUTOMATIC_MARGIN * level[:, 0], 2 * np.maximum(prior_bound, 0.0))
        variation = per_proposer_bound(variation, potential.num_clients, num_proposers, d, dtype)
        second = np.asarray(weights.sup, np.float64)
        if num_proposers > potential.num_clients:
            second = np.concatenate([second, np.zeros((1, d))])
        bound = SampledRowBound(variation.clients, variation.prior, jnp.zeros((num_proposers, d), dtype),
                                jnp.asarray(second, dtype), jnp.asarray(horizon, dtype))
        return bound, weights

    def _search_mode(self, flat_potential, start, init_params, ravel, vectorized, num_warmup, *, hessian=None):
        """``(start, use_cv, recenter)`` after looking for the mode when the control variates
        or a Laplace preconditioner need it (one mode for all chains: it is the target's)."""
        kind = self._bound_kind()
        search_from = start
        if init_params is not None:
            search_from = ravel(init_params)[0] if vectorized else ravel(init_params)
        search = self.mode_search = find_mode(flat_potential, search_from, hessian=hessian, tally=self.setup_tally)
        if search.is_mode:
            self.reference_point = search.point
            return search.point, True, False
        if isinstance(self.preconditioner, str):
            raise ValueError(
                f"preconditioner={self.preconditioner!r} is the Laplace approximation at the "
                f"mode, and the posterior has none here ({describe_no_mode(search)}): pass "
                "preconditioner=None or a scale"
            )
        if num_warmup > 0:
            return start, True, True  # the chains start at init_strategy's point
        if kind == "hessian":
            raise ValueError(
                f"HessianBound with control variates needs a reference point, and the "
                f"posterior has no mode here ({describe_no_mode(search)}): give MCMC num_warmup > 0 "
                "(the reference is then the mean of the warmup trajectory) or pass "
                "control_variates=False"
            )
        warn_user(
            f"FedZigZag: control variates are off: the posterior has no mode "
            f"({describe_no_mode(search)}) and without warmup there is no trajectory to center "
            "them on; give MCMC num_warmup > 0 to have them",
            RuntimeWarning,
        )
        return start, False, False

    def _preconditioning(self, flat_potential, d, dtype, *, hessian=None):
        """The :class:`~numpyro_fed.infer.zigzag.Preconditioner` asked for, or ``None``."""
        if self.preconditioner is None:
            return None
        if isinstance(self.preconditioner, str):
            if self.setup_tally is not None:
                self.setup_tally.add("hessian")
            return laplace_preconditioner(flat_potential, self.reference_point,
                                          diagonal=self.preconditioner == "diagonal", hessian=hessian)
        return user_preconditioner(self.preconditioner, self.reference_point, d, dtype)

    # -- the clients' program (with a federation) ------------------------------------------

    def _data_key(self, potential):
        if potential.deployed:  # the rows are the loaders' (on the clients): their counts are known
            return _program_key(potential.client_sizes, "deployed", self.private_randomness)
        return _program_key(potential.client_data, self.private_randomness)

    def _start_program(self, potential, functions, key, data_key):
        """Starts the federation on ``functions`` (the set-up calls and, when known, the
        proposals) unless it runs this kernel's program for ``key`` already. What the set-up
        calls counted in the federation's ledger is kept across a restart."""
        fed = self.federation
        if fed.started and fed.program is self._program and key == self._program_key:
            return
        previous = fed.ledger if fed.started and fed.program is self._program else None
        program = potential.client_program(functions, transform=_PrivateSeed() if self.private_randomness else None)
        fed.start(program)
        if previous is not None:
            _carry_ledger(previous, fed.ledger)
        self._program, self._program_key, self._program_data = program, key, data_key

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        # MCMC(..., chain_method="vectorized") passes one key per chain.
        vectorized = not is_prng_key(rng_key)
        first_key = rng_key[0] if vectorized else rng_key
        potential = self.init_potential(jax.random.fold_in(first_key, 0), model_args, model_kwargs)
        federated = self.federation is not None
        # in deployment this builds closures only: with a federation the clients are asked
        proposers, prior_weights = proposers_from_potential(potential, prior=self.prior)
        use_cv = potential.num_clients > 1 if self.control_variates is None else bool(self.control_variates)
        layout = None
        self.rows_per_gradient = np.asarray(potential.client_sizes, np.int64)
        if self.subsample_size is not None:
            layout = subsample_layout(potential, self.subsample_size)
            use_cv = True
            self.rows_per_gradient = np.full(potential.num_clients, rows_per_estimate(layout), np.int64)
        ravel = jax.vmap(potential.ravel) if vectorized else potential.ravel
        start = potential.ravel(potential.init_params)
        d = start.shape[-1]
        num_warmup = int(num_warmup)
        order = 2 if self.control_variates == "second_order" or (
            layout is not None and self._subsample_order() == 2) else 1
        redistribution_rate = self.redistribution_rate if self.prior == "redistribute" else 0.0
        bounds = self.bounds
        if layout is not None:  # a placeholder of the right kind until the clients' bounds are in
            bounds = HessianBound(jnp.zeros((proposers.num, d, d), start.dtype), jnp.zeros((d, d), start.dtype))
        elif not isinstance(bounds, str):
            bounds = per_proposer_bound(bounds, potential.num_clients, proposers.num, d, start.dtype)
        hessian = terms = None
        self.setup_tally = None
        if federated:
            # the set-up through the federation: the clients answer named calls on their rows
            clients = client_functions(potential)
            self.setup_tally = SetupTally(d, start.dtype.itemsize)

            def program(reference, preconditioning):
                self.message_sizes = {}
                kernel, client_fn = build_federated_kernel(
                    self.federation, clients, num_clients=potential.num_clients,
                    prior_on_server=self.prior == "server", reference=reference, excess_rate=self.excess_rate,
                    redistribution_rate=redistribution_rate, bounds=bounds, grid_size=self.grid_size,
                    safety_factor=self.safety_factor, max_proposals=self.max_proposals,
                    full_covariance=self.full_covariance, skeleton_size=self.skeleton_size,
                    preconditioner=preconditioning, counts=self.privacy is None, second_order=order == 2,
                    sizes=self.message_sizes, subsample=layout,
                )
                # the workers keep their program (and what they compiled) while it does not change;
                # the subsampling's bounds are round arguments, not part of the program
                key = _program_key(data_key, self.privacy is None, reference is not None, order,
                                   repr(layout) if layout is not None else bounds,
                                   preconditioning, self.excess_rate, self.grid_size, self.safety_factor)
                return kernel, functions_of(client_fn, reference is not None), key

            def functions_of(client_fn, use_reference):
                functions = setup_functions(potential.flat().client_potential)
                if layout is not None:
                    row_bound = self.bounds.rows if isinstance(self.bounds, RowHessianBound) else None
                    functions["row_curvature"] = partial(_row_curvature_call, clients.grad, layout, row_bound)
                if client_fn is not None:
                    functions["propose"] = client_fn
                if not self.private_randomness:
                    return functions
                # the round's arguments: x, v, window (and the reference point and mean
                # gradient), then the client's own: its key first
                key_index = 3 + 2 * bool(use_reference)
                return {name: partial(_with_private_key, fn, key_index) if name == "propose" else partial(_on_rows, fn)
                        for name, fn in functions.items()}

            data_key = self._data_key(potential)
            fed = self.federation
            if not (fed.started and fed.program is self._program and self._program_data == data_key):
                if self.preconditioner is None:  # the proposals' program is known before the set-up
                    placeholder = ControlVariates(start, jnp.zeros((proposers.num, d), start.dtype), start) \
                        if use_cv else None
                    _, functions, key = program(placeholder, None)
                else:
                    functions, key = functions_of(None, False), None
                self._start_program(potential, functions, key, data_key)
            terms = ClientTerms(fed, potential.flat().prior_potential, potential.num_clients, self.prior == "server")
            proposers = terms.proposers(clients.prior_grad_and_slope)
            flat_potential, hessian = terms.potential, terms.hessian
        else:
            flat_potential = jax.jit(potential.flat().potential)
        self.reference_point = None
        self.mode_search = None
        recenter = False  # re-center the control variates on the warmup trajectory
        if use_cv or isinstance(self.preconditioner, str):
            start, found_cv, recenter = self._search_mode(flat_potential, start, init_params, ravel,
                                                          vectorized, num_warmup, hessian=hessian)
            use_cv = use_cv and found_cv
            if layout is not None and not self.mode_search.is_mode:
                raise ValueError(
                    f"FedZigZag(subsample_size={self.subsample_size}) estimates the rates around the "
                    f"posterior's mode, and the posterior has none here ({describe_no_mode(self.mode_search)}): "
                    "reparametrize the model (e.g. non-centered) or pass subsample_size=None")
        if init_params is not None:
            start = ravel(init_params)

        self.preconditioning = self._preconditioning(flat_potential, d, start.dtype, hessian=hessian)
        if self.preconditioning is not None:
            proposers = precondition(proposers, self.preconditioning)
            if not isinstance(bounds, str):
                bounds = preconditioned_bound(bounds, self.preconditioning)
            start = self.preconditioning.to_u(start)
        reference = None
        reference_fn = None
        if federated:
            reference_fn = partial(federated_reference, terms, proposers.prior_grad_and_slope, order=order,
                                   preconditioner=self.preconditioning)
        if use_cv:
            # without a mode: a placeholder at the start, inactive until the first re-centering
            point = self.reference_point if self.reference_point is not None else (start[0] if start.ndim == 2 else start)
            if self.preconditioning is not None and self.reference_point is not None:
                point = self.preconditioning.to_u(point)
            if federated:
                reference = reference_fn(point)
                self.setup_tally.add("value_and_grad")
                if order == 2:
                    self.setup_tally.add("hessian")
            else:  # one compiled call (eagerly, each operation over the clients' rows compiles on its own)
                reference = jax.jit(partial(control_variate_reference, proposers, order=order))(point)
        if layout is not None:
            row_grad = (clients if federated else client_functions(potential)).grad
            if self.preconditioning is not None:  # in process only: the process's space is u
                row_grad = preconditioned_row_grad(row_grad, self.preconditioning)
            bounds, weights = self._subsample_bounds(potential, layout, reference, flat_potential, hessian,
                                                     row_grad, proposers.num, order=order)
            self.subsample_bounds = bounds
            if not federated:
                proposers = subsampled_proposers(proposers, row_grad, potential.client_data,
                                                 potential.num_clients, layout, weights)
        if federated:
            kernel, functions, key = program(reference, self.preconditioning)
            self._start_program(potential, functions, key, data_key)
            kernel = jax.jit(kernel)
        else:
            kernel = jax.jit(build_kernel(
                proposers, reference=reference, excess_rates=jnp.full(proposers.num, self.excess_rate),
                redistribution_rate=redistribution_rate, bounds=bounds,
                grid_size=self.grid_size, safety_factor=self.safety_factor, max_proposals=self.max_proposals,
                batched=vectorized, full_covariance=self.full_covariance, skeleton_size=self.skeleton_size,
            ))
        # on an engine a worker can fail mid-run: keep every completed draw on the host
        keep_on_host = federated and not isinstance(self.federation, InProcess)
        self.last_completed_state = None
        self.completed_draws = []
        to_x = self.preconditioning.to_x if self.preconditioning is not None else (lambda u: u)
        unravel = potential.unravel
        adapt_update = warmup_adaptation(
            proposers, num_warmup=num_warmup if use_cv else 0, recenter=recenter, order=order,
            can_switch_off=self._bound_kind() not in ("hessian", "subsample"), max_proposals=self.max_proposals,
            reference_fn=reference_fn, interval_warmup=num_warmup if self.sample_interval is None else 0,
        )
        if self.sample_interval is not None:
            first_interval = self.sample_interval
        else:
            first_interval = INITIAL_INTERVAL if num_warmup else DEFAULT_INTERVAL

        grow_bound = partial(_grow_bound, num_warmup=num_warmup, subsample_size=self.subsample_size,
                             origin=user_origin())

        def sample_fn(state):
            adapt = state.adapt
            key, k_sample = jax.random.split(state.rng_key)
            duration = jnp.where(adapt.stalled, 0.0, adapt.interval)  # a stalled chain stops
            control = switched(adapt.reference, adapt.active) if use_cv else None
            bound_scale = state.bound_scale
            if layout is None:
                core, info = kernel(k_sample, state.core, duration, control)
            else:
                core, info = kernel(k_sample, state.core, duration, control, bound_scale=bound_scale)
                bound_scale = grow_bound(bound_scale, info, state.i)
            info = info._replace(hit_event_cap=info.hit_event_cap | adapt.stalled)
            adapt = adapt_update(adapt, core, info, state.i)
            new = FedZigZagState(state.i + 1, unravel(to_x(core.x)), core, info, key, adapt, bound_scale)
            if keep_on_host:  # the draw is complete: the host keeps it (a worker may fail next)
                done = jax.pure_callback(self._keep_completed, jax.ShapeDtypeStruct((), jnp.int32), new,
                                         vmap_method="expand_dims")
                new = new._replace(i=new.i + done)
            return new

        def init_fn(key, u):
            k_velocity, key = jax.random.split(key)
            if federated:
                core = federated_init(u, k_velocity, prior_weights, scale=self.initial_horizon)
            else:
                core = init(u, k_velocity, prior_weights, horizon=self.initial_horizon, bounds=bounds,
                            grid_size=self.grid_size)
            info = SampleInfo.zeros(proposers.num, d, u.dtype, skeleton_size=self.skeleton_size,
                                    full_covariance=self.full_covariance)
            adapt = init_warmup(reference, use_cv and not recenter, u, first_interval)
            bound_scale = None if layout is None else jnp.ones((), u.dtype)
            return FedZigZagState(jnp.zeros((), jnp.int32), unravel(to_x(core.x)), core, info, key, adapt, bound_scale)

        if vectorized:
            num_chains = rng_key.shape[0]
            start = jnp.broadcast_to(start, (num_chains,) + start.shape[-1:])
            sample_fn, init_fn = jax.vmap(sample_fn), jax.vmap(init_fn)
        # NumPyro skips init (and this set-up) when it has a state and the sample function.
        self._sample_fn = sample_fn
        return init_fn(rng_key, start)
