"""The NumPyro face of the federated Zig-Zag sampler: an ``MCMCKernel`` over the core.

The face checks its settings (:mod:`~numpyro_fed.infer.zigzag.options`), sets a run up in
``init`` (the mode, the preconditioner, the control variates, the subsampling's bounds of
:mod:`~numpyro_fed.infer.zigzag.subsample_setup`, the clients' program of
:mod:`~numpyro_fed.infer.zigzag.program`), builds the core's kernel and hands NumPyro the
draw functions of :mod:`~numpyro_fed.infer.zigzag.draws`; what a run recorded is read by
:mod:`~numpyro_fed.infer.zigzag.diagnostics`. The user guide (``docs/guide/zigzag.md``) says
what every option does and why.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer.initialization import init_to_uniform
from numpyro.util import is_prng_key

from numpyro_fed._checks import user_origin, warn_user
from numpyro_fed.infer.kernel import FederatedMCMCKernel
from numpyro_fed.infer.modes import OTHER_MODE_WARNING, second_start
from numpyro_fed.infer.zigzag.bounds import HessianBound, per_proposer_bound
from numpyro_fed.infer.zigzag.control_variates import ControlVariates
from numpyro_fed.infer.zigzag.diagnostics import (
    DIAGNOSTICS,
)
from numpyro_fed.infer.zigzag.draws import DrawSettings, FirstDraw, first_draw, next_draw
from numpyro_fed.infer.zigzag.federated import build_federated_kernel, federated_init
from numpyro_fed.infer.zigzag.kernel import build_kernel, init
from numpyro_fed.infer.zigzag.mode import describe_no_mode, describe_other_mode, find_mode, pick_mode
from numpyro_fed.infer.zigzag.options import check_options
from numpyro_fed.infer.zigzag.preconditioning import (
    laplace_preconditioner,
    precondition,
    preconditioned_bound,
    preconditioned_row_grad,
    user_preconditioner,
)
from numpyro_fed.infer.zigzag.program import ProgramCache, client_calls, program_key
from numpyro_fed.infer.zigzag.proposers import client_functions, federation_proposers, initial_prior_weights
from numpyro_fed.infer.zigzag.reporting import ZigZagReports
from numpyro_fed.infer.zigzag.setup import ClientTerms, federated_reference
from numpyro_fed.infer.zigzag.subsample import rows_per_estimate, subsample_layout, subsampled_proposers
from numpyro_fed.infer.zigzag.subsample_setup import SubsampleBoundSetup, grow_bound, subsample_bounds, subsample_order
from numpyro_fed.infer.zigzag.warmup import DEFAULT_INTERVAL, INITIAL_INTERVAL, warmup_adaptation

__all__ = ["FedZigZag"]


class _Plan(NamedTuple):
    """What one ``init`` decided before the set-up: the subsampling's layout (or ``None``),
    whether control variates are asked for and their order, the prior's redistribution rate,
    the bounds' placeholder or per-proposer layout, and the clients' data key (with a
    federation)."""

    layout: Any
    use_cv: bool
    order: int
    redistribution_rate: float
    bounds: Any
    data_key: Any = None


class FedZigZag(ZigZagReports, FederatedMCMCKernel):
    """Federated Zig-Zag sampler (Bierkens, Duncan et al. 2022, Algorithm 2) as a NumPyro
    :class:`~numpyro.infer.mcmc.MCMCKernel`.

    Each client proposes its next switching time from its own term of the potential (see
    :func:`~numpyro_fed.split_potential`); the server takes the earliest. One MCMC sample is
    the position after ``sample_interval`` units of process time. The user guide
    (``docs/guide/zigzag.md``) explains every option; in short:

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`.
    :param float sample_interval: process time between two samples (> 0); ``None`` (default):
        adapted during the warmup ("Warmup that adapts").
    :param control_variates: ``None`` (default: on when M > 1), ``True``/``"first_order"``,
        ``"second_order"`` or ``False`` ("Control variates").
    :param str prior: ``"server"``, ``"clients"`` or ``"redistribute"`` ("The prior").
    :param float redistribution_rate: rate of the prior's redistribution (> 0).
    :param float excess_rate: refreshment rate added to every proposer (>= 0).
    :param bounds: ``"grid"`` (default), ``"affine"``, a :class:`GradientBound` or a
        :class:`HessianBound` (with ``subsample_size``: a :class:`RowHessianBound`).
    :param int grid_size: grid points of the automatic bound (>= 2).
    :param float safety_factor: multiplies the automatic bounds (>= 1).
    :param float initial_horizon: starting horizon of the bounds (> 0).
    :param int max_proposals: proposals a sample may make without a switch before its chain
        stops (see "The reference point, and posteriors without a mode").
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: NumPyro init strategy: where the chain (or the search for the mode)
        starts.
    :param float dp_sensitivity: ``K > 1`` of Theorem 5.1; with ``dp_epsilon`` and
        ``dp_delta`` turns on the per-message privacy guarantee, :attr:`privacy` ("Privacy by
        refreshment").
    :param int skeleton_size: switches recorded per sample (:meth:`skeleton`).
    :param bool full_covariance: integrate ``x x^T`` in full for :meth:`trajectory_moments`.
    :param preconditioner: ``"auto"`` (default: ``"laplace"`` where the posterior has a mode,
        none where it has not, with a privacy guarantee, with ``subsample_size`` or with a
        ``sample_interval`` given, a time in the model's units), ``None``,
        ``"laplace"``, ``"diagonal"`` or a scale ("Preconditioning").
    :param federation: the :class:`~numpyro_fed.federation.Federation` the clients answer
        through; ``None`` (default): a new :class:`~numpyro_fed.federation.InProcess` (the
        clients vectorized in this process). What crossed it is counted in
        :meth:`message_ledger` (the federation guide, "FedZigZag").
    :param str thinning: who thins the proposals: ``"server"`` (the superposition of the
        clients' rates, each line's bound asking every client and the check the winner alone:
        for a federation that runs in process), ``"clients"`` (Algorithm 2 as messages: every
        client thins its own proposals, one round per switch) or ``"auto"`` (default: the
        first in process, else the second). Both give the same process ("One algorithm, two
        ways to thin").
    :param bool private_randomness: each client draws its proposals from a key the server
        does not know (needs the clients' thinning). ``None`` (default): so whenever a privacy
        guarantee is asked for and the clients are parties apart from the server (an engine, or
        ``loader=``); ``False`` makes such runs reproducible, and :attr:`privacy` then says the
        guarantee does not hold against the server.
    :param int subsample_size: ``b``: each client checks a proposal against an estimate of
        its rate from ``b`` of its rows ("Subsampling: ``subsample_size``").

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

    The same with every client thinning its own proposals (here in process; given
    ``nf.RayFederation()``, on workers): one round of messages per switch.

    >>> from numpyro_fed.federation import InProcess
    >>> sampler = nf.FedZigZag(model, sample_interval=0.2, federation=InProcess(), thinning="clients")
    >>> mcmc = MCMC(sampler, num_warmup=50, num_samples=200, progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(1), y)
    >>> fields = mcmc.get_extra_fields()
    >>> bool(fields["info.rounds"].sum() >= fields["info.num_events"].sum())
    True
    >>> sampler.message_ledger(mcmc)["bytes_from_client"].shape  # one entry per client
    (4,)
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
        preconditioner="auto",
        federation=None,
        private_randomness: bool | None = None,
        subsample_size: int | None = None,
        thinning: str = "auto",
    ):
        super().__init__(model, partition=partition, init_strategy=init_strategy, federation=federation)
        options = check_options(
            sample_interval=sample_interval,
            control_variates=control_variates,
            prior=prior,
            redistribution_rate=redistribution_rate,
            excess_rate=excess_rate,
            bounds=bounds,
            grid_size=grid_size,
            safety_factor=safety_factor,
            initial_horizon=initial_horizon,
            max_proposals=max_proposals,
            dp_sensitivity=dp_sensitivity,
            dp_epsilon=dp_epsilon,
            dp_delta=dp_delta,
            skeleton_size=skeleton_size,
            full_covariance=full_covariance,
            preconditioner=preconditioner,
            federation=federation,
            private_randomness=private_randomness,
            subsample_size=subsample_size,
            thinning=thinning,
        )
        # each checked setting under its argument's name (what repr shows); ``privacy`` too
        vars(self).update(options._asdict())
        # repr shows what was asked for: not "auto"'s choice (the shared face already hides the
        # InProcess() that federation=None means)
        self._defaulted = {"thinning"} if thinning == "auto" else set()
        if private_randomness is None:
            self._defaulted.add("private_randomness")
        #: with the clients' thinning: the bytes of one round's message to a client and of its reply
        self.message_sizes = {}
        #: with an engine backend: the state after the last completed draw and every completed
        #: draw's ``z``, kept on the host (a worker can fail mid-run; see the user guide)
        self.last_completed_state = None
        self.completed_draws = []
        self._programs = ProgramCache()
        #: after ``init``: the federation's ledger before the set-up (a run's ledger is what
        #: the federation counted since, plus what the core counted itself) and the sizes of
        #: the server's thinning's messages, ``(d, itemsize)``
        self.ledger_baseline = None
        self.message_dims = None
        #: after ``init``: the :class:`~numpyro_fed.infer.zigzag.Preconditioner` (or ``None``),
        #: the mode (or ``None``) and the search for it (a :class:`ModeSearch`); a second mode
        #: the search from a second start found (an :class:`OtherMode`), or ``None``
        self.preconditioning = None
        self.reference_point = None
        self.mode_search = self.other_mode = None
        #: row gradients one gradient evaluation of each client costs (``(M,)``, after
        #: ``init``): its rows, or with ``subsample_size`` the rows one estimate evaluates
        self.rows_per_gradient = None
        #: with ``subsample_size``, after ``init``: the clients' curvature bounds, laid out per
        #: proposer (with the clients' thinning a :class:`HessianBound`; with the server's a
        #: :class:`~numpyro_fed.infer.zigzag.bounds.SampledRowBound`, whose ``sup`` are the
        #: importance-sampled rows' summed curvatures), and whether the automatic bound
        #: found a curvature that grows away from the posterior (violations possible)
        self.subsample_bounds = None
        self.unbounded_curvature = False
        #: with ``subsample_size`` through a federation, after ``init``: the seconds the clients'
        #: set-up call took, by call name (``"row_remainders"``: second order; the workers'
        #: compilation and computation of their weights, in parallel, and its round trip)
        self.subsample_setup_seconds = {}
        self._client_state = None

    def hyperparameters(self) -> dict:
        values = super().hyperparameters()
        return {name: value for name, value in values.items() if name not in self._defaulted}

    # -- draws -------------------------------------------------------------------------------

    def _keep_completed(self, state):
        """Host side: keeps the state after a completed draw (and its draw)."""
        state = jax.tree.map(np.asarray, state)  # a leading chain axis under vectorized chains
        self.last_completed_state = state
        self.completed_draws.append(state.z)
        return np.zeros(np.shape(state.i), np.int32)

    # -- set-up: the mode, the preconditioner, the kernel ------------------------------------

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        # MCMC(..., chain_method="vectorized") passes one key per chain.
        vectorized = not is_prng_key(rng_key)
        first_key = rng_key[0] if vectorized else rng_key
        potential = self.init_potential(jax.random.fold_in(first_key, 0), model_args, model_kwargs)
        server_thinning = self.thinning == "server"
        num_warmup = int(num_warmup)
        prior_weights = initial_prior_weights(potential.num_clients, self.prior)
        ravel = jax.vmap(potential.ravel) if vectorized else potential.ravel
        start = potential.ravel(potential.init_params)
        plan = self._plan(potential, prior_weights.shape[0], start)
        bounds = plan.bounds
        # the set-up asks the clients, whoever thins
        clients, terms, proposers, plan = self._set_up(potential, plan, prior_weights.shape[0], start)
        flat_potential, hessian = terms.potential, terms.hessian
        if server_thinning:  # the core's proposers: every client's term through the federation's calls
            proposers = federation_proposers(
                self.federation, clients.prior_grad_and_slope, potential.num_clients, prior=self.prior
            )
        self.reference_point = None
        self.mode_search = self.other_mode = None
        self._client_state = None
        use_cv, recenter = plan.use_cv, False  # recenter: the control variates on the warmup trajectory
        if use_cv or isinstance(self.preconditioner, str):
            start, found_cv, recenter = self._search_mode(
                terms, start, init_params, ravel, vectorized, num_warmup, jax.random.fold_in(first_key, 1)
            )
            use_cv = use_cv and found_cv
            if plan.layout is not None and not self.mode_search.is_mode:
                raise ValueError(
                    f"FedZigZag(subsample_size={self.subsample_size}) estimates the rates around the "
                    f"posterior's mode, and the posterior has none here ({describe_no_mode(self.mode_search)}): "
                    "reparametrize the model (e.g. non-centered) or pass subsample_size=None"
                )
        if init_params is not None:
            start = ravel(init_params)
        self.preconditioning = self._preconditioning(flat_potential, start.shape[-1], start.dtype, hessian=hessian)
        if self.preconditioning is not None:
            proposers = precondition(proposers, self.preconditioning)
            if not isinstance(bounds, str):
                bounds = preconditioned_bound(bounds, self.preconditioning)
            start = self.preconditioning.to_u(start)
        reference_fn = partial(
            federated_reference,
            terms,
            proposers.prior_grad_and_slope,
            order=plan.order,
            preconditioner=self.preconditioning,
        )
        reference = self._reference(plan, start, reference_fn) if use_cv else None
        if plan.layout is not None:
            bounds, proposers = self._subsampling(potential, plan, reference, hessian, clients, proposers)
        kernel = self._kernel(potential, plan, clients, proposers, bounds, reference, vectorized)
        draws = DrawSettings(
            kernel=kernel,
            use_cv=use_cv,
            unravel=potential.unravel,
            to_x=self.preconditioning.to_x if self.preconditioning is not None else (lambda u: u),
            adapt_update=warmup_adaptation(
                proposers,
                num_warmup=num_warmup if use_cv else 0,
                recenter=recenter,
                order=plan.order,
                can_switch_off=self._bound_kind() not in ("hessian", "subsample"),
                max_proposals=self.max_proposals,
                reference_fn=reference_fn,
                interval_warmup=num_warmup if self.sample_interval is None else 0,
            ),
            grow_bound=None
            if plan.layout is None
            else partial(grow_bound, num_warmup=num_warmup, subsample_size=self.subsample_size, origin=user_origin()),
            # on an engine a worker can fail mid-run: keep every completed draw on the host
            keep_completed=None if self.federation.in_process else self._keep_completed,
        )
        self.last_completed_state = None
        self.completed_draws = []
        if server_thinning:
            init_core = partial(
                init, prior_weights=prior_weights, horizon=self.initial_horizon, bounds=bounds, grid_size=self.grid_size
            )
        else:
            init_core = partial(
                federated_init,
                prior_weights=prior_weights,
                scale=self.initial_horizon,
                client_state=self._client_state,
            )
        if self.sample_interval is not None:
            first_interval = self.sample_interval
        else:
            first_interval = INITIAL_INTERVAL if num_warmup else DEFAULT_INTERVAL
        first = FirstDraw(
            init_core=init_core,
            num_proposers=proposers.num,
            skeleton_size=self.skeleton_size,
            full_covariance=self.full_covariance,
            reference=reference,
            active=use_cv and not recenter,
            interval=first_interval,
            subsampled=plan.layout is not None,
            unravel=potential.unravel,
            to_x=draws.to_x,
        )
        sample_fn, init_fn = partial(next_draw, draws), partial(first_draw, first)
        if vectorized:
            start = jnp.broadcast_to(start, (rng_key.shape[0],) + start.shape[-1:])
            sample_fn, init_fn = jax.vmap(sample_fn), jax.vmap(init_fn)
        # NumPyro skips init (and this set-up) when it has a state and the sample function.
        self._sample_fn = sample_fn
        return init_fn(rng_key, start)

    def _plan(self, potential, num_proposers, start) -> _Plan:
        """What ``init`` decides from the settings and the potential before any set-up (and
        :attr:`rows_per_gradient`)."""
        use_cv = potential.num_clients > 1 if self.control_variates is None else bool(self.control_variates)
        layout = None
        self.rows_per_gradient = np.asarray(potential.client_sizes, np.int64)
        if self.subsample_size is not None:
            layout = subsample_layout(potential, self.subsample_size)
            use_cv = True
            self.rows_per_gradient = np.full(potential.num_clients, rows_per_estimate(layout), np.int64)
        order = (
            2
            if self.control_variates == "second_order"
            or (layout is not None and subsample_order(self.control_variates, self.bounds) == 2)
            else 1
        )
        d, dtype = start.shape[-1], start.dtype
        bounds = self.bounds
        if layout is not None:  # a placeholder of the right kind until the clients' bounds are in
            bounds = HessianBound(jnp.zeros((num_proposers, d, d), dtype), jnp.zeros((d, d), dtype))
        elif not isinstance(bounds, str):
            bounds = per_proposer_bound(bounds, potential.num_clients, num_proposers, d, dtype)
        redistribution_rate = self.redistribution_rate if self.prior == "redistribute" else 0.0
        return _Plan(layout, use_cv, order, redistribution_rate, bounds)

    def _set_up(self, potential, plan, num_proposers, start):
        """Starts the federation on the clients' program (with the proposals when they are known
        before the set-up) and returns ``(clients, terms, proposers, plan)``: the clients'
        functions, the :class:`~numpyro_fed.infer.zigzag.setup.ClientTerms` that reach them by
        named calls, the server's view of the proposers, and ``plan`` with the data key."""
        clients = client_functions(potential)
        d = start.shape[-1]
        self.message_dims = (d, start.dtype.itemsize)
        plan = plan._replace(data_key=self._programs.data_key_of(potential, self.private_randomness))
        fed = self.federation
        if not self._programs.runs_data(fed, plan.data_key):
            if self.thinning == "server":  # the clients' terms, and the set-up calls
                functions, key = self._client_calls(potential, clients, plan, None, False, terms=True), None
            elif self.preconditioner is None:  # the proposals' program is known before the set-up
                placeholder = (
                    ControlVariates(start, jnp.zeros((num_proposers, d), start.dtype), start) if plan.use_cv else None
                )
                _, functions, key = self._federated_program(potential, clients, plan, plan.bounds, placeholder, None)
            else:
                functions, key = self._client_calls(potential, clients, plan, None, False), None
            self._programs.start(
                fed, potential, functions, key, plan.data_key, private_randomness=self.private_randomness
            )
        self.ledger_baseline = fed.ledger.summary()
        terms = ClientTerms(fed, potential.flat().prior_potential, potential.num_clients, self.prior == "server")
        return clients, terms, terms.proposers(clients.prior_grad_and_slope), plan

    def _client_calls(self, potential, clients, plan, propose, use_reference, terms=False):
        return client_calls(
            potential,
            clients,
            layout=plan.layout,
            bounds=self.bounds,
            propose=propose,
            use_reference=use_reference,
            private_randomness=self.private_randomness,
            terms=terms,
            remainders=plan.layout is not None and plan.order == 2 and self.thinning == "clients",
        )

    def _federated_program(self, potential, clients, plan, bounds, reference, preconditioning):
        """``(kernel, functions, key)``: the server's kernel through the federation, the
        clients' calls and the key of the program they make (the workers keep their program,
        and what they compiled, while it does not change; the subsampling's bounds are round
        arguments, not part of the program)."""
        self.message_sizes = {}
        kernel, propose = build_federated_kernel(
            self.federation,
            clients,
            num_clients=potential.num_clients,
            prior_on_server=self.prior == "server",
            reference=reference,
            excess_rate=self.excess_rate,
            redistribution_rate=plan.redistribution_rate,
            bounds=bounds,
            grid_size=self.grid_size,
            safety_factor=self.safety_factor,
            max_proposals=self.max_proposals,
            full_covariance=self.full_covariance,
            skeleton_size=self.skeleton_size,
            preconditioner=preconditioning,
            counts=self.privacy is None,
            second_order=plan.order == 2,
            sizes=self.message_sizes,
            subsample=plan.layout,
        )
        key = program_key(
            plan.data_key,
            self.privacy is None,
            reference is not None,
            plan.order,
            repr(plan.layout) if plan.layout is not None else bounds,
            preconditioning,
            self.excess_rate,
            self.grid_size,
            self.safety_factor,
        )
        return kernel, self._client_calls(potential, clients, plan, propose, reference is not None), key

    def _reference(self, plan, start, reference_fn):
        """The control variates' :class:`~numpyro_fed.infer.zigzag.ControlVariates` at the mode
        (in the process's space); without a mode a placeholder at the start, inactive until
        the warmup's first re-centering."""
        point = self.reference_point if self.reference_point is not None else (start[0] if start.ndim == 2 else start)
        if self.preconditioning is not None and self.reference_point is not None:
            point = self.preconditioning.to_u(point)
        # one compiled call (eagerly, each operation over the clients' rows compiles on its own)
        return jax.jit(reference_fn)(point)

    def _subsampling(self, potential, plan, reference, hessian, clients, proposers):
        """``(bounds, proposers)`` with subsampling: the clients' bounds on their rate
        estimates (:attr:`subsample_bounds`) and, with the server's thinning (in process), the
        proposers that estimate from the blocks the federation holds in this process."""
        server_thinning = self.thinning == "server"
        row_grad = clients.grad
        if self.preconditioning is not None:  # the server's thinning only: the process's space is u
            row_grad = preconditioned_row_grad(row_grad, self.preconditioning)
        self.subsample_setup_seconds = {}
        setup = SubsampleBoundSetup(
            self.bounds,
            self.subsample_size,
            self.preconditioning,
            None if server_thinning else self.federation,
            self.federation.blocks if server_thinning else None,
            self.subsample_setup_seconds,
        )
        bounds, weights, self.unbounded_curvature = subsample_bounds(
            setup, potential, plan.layout, reference, hessian, row_grad, proposers.num, order=plan.order
        )
        self.subsample_bounds = bounds
        # second order through a federation: the clients keep their weights (their client state)
        self._client_state = None if server_thinning or plan.order == 1 else weights
        if server_thinning:
            proposers = subsampled_proposers(
                proposers, row_grad, self.federation.blocks, potential.num_clients, plan.layout, weights
            )
        return bounds, proposers

    def _kernel(self, potential, plan, clients, proposers, bounds, reference, vectorized):
        """The core's compiled kernel: the server thinning the superposition of the clients'
        proposals, or every client thinning its own (the federation started on its program)."""
        if self.thinning == "clients":
            kernel, functions, key = self._federated_program(
                potential, clients, plan, bounds, reference, self.preconditioning
            )
            self._programs.start(
                self.federation, potential, functions, key, plan.data_key, private_randomness=self.private_randomness
            )
            return jax.jit(self._counted_by_kernel(kernel))
        return jax.jit(
            self._counted_by_kernel(
                build_kernel(
                    proposers,
                    reference=reference,
                    excess_rates=jnp.full(proposers.num, self.excess_rate),
                    redistribution_rate=plan.redistribution_rate,
                    bounds=bounds,
                    grid_size=self.grid_size,
                    safety_factor=self.safety_factor,
                    max_proposals=self.max_proposals,
                    batched=vectorized,
                    full_covariance=self.full_covariance,
                    skeleton_size=self.skeleton_size,
                )
            )
        )

    def _counted_by_kernel(self, kernel):
        """``kernel`` traced with its calls of the clients counted by itself (its draws' infos:
        the rounds, or the proposers' gradient evaluations), not by the federation: they
        happen at every event, where a counting callback would cost more than the call."""

        def run(*args, **kwargs):
            with self.federation.counted_by_caller():
                return kernel(*args, **kwargs)

        return run

    def _search_mode(self, terms, start, init_params, ravel, vectorized, num_warmup, rng_key):
        """``(start, use_cv, recenter)`` after looking for the mode when the control variates
        or a Laplace preconditioner need it (one mode for all chains: it is the target's).

        Without ``init_params`` the search runs from two starts, ``init_strategy``'s point and
        the prior's medians (:func:`~numpyro.infer.initialization.init_to_median`; with that
        strategy already, a point of :func:`~numpyro.infer.initialization.init_to_uniform`),
        and the chain starts at the mode with the larger Laplace mass: a Zig-Zag process
        rarely crosses between separated modes, so a start in a minor one (a mixture's
        label-swapped mode) would stay there. A second mode with at least
        :data:`~numpyro_fed.infer.modes.OTHER_MODE_WARNING` of the mass is a warning (:attr:`other_mode`)."""
        kind = self._bound_kind()
        search_from = start
        if init_params is not None:
            search_from = ravel(init_params)[0] if vectorized else ravel(init_params)
        search = self.mode_search = find_mode(
            terms.potential, search_from, hessian=terms.hessian, counted_evaluations=terms.counted_evaluations
        )
        if init_params is None:
            search = self.mode_search = self._second_start(terms, search, rng_key)
        if search.is_mode:
            self.reference_point = search.point
            return search.point, True, False
        if isinstance(self.preconditioner, str) and self.preconditioner != "auto":
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

    def _second_start(self, terms, search, rng_key):
        """The mode a chain starts at, after a second search (see :meth:`_search_mode`)."""
        potential = self.federated_potential
        x0 = second_start(potential, self.init_strategy, rng_key, search.point.dtype)
        if x0 is None:
            return search
        other_search = find_mode(
            terms.potential, x0, hessian=terms.hessian, counted_evaluations=terms.counted_evaluations
        )
        search, other = pick_mode(search, other_search)
        self.other_mode = other
        if other is not None and other.share >= OTHER_MODE_WARNING:
            warn_user(f"FedZigZag: {describe_other_mode(search, other, potential.coordinate_names)}", RuntimeWarning)
        return search

    def _preconditioning(self, flat_potential, d, dtype, *, hessian=None):
        """The :class:`~numpyro_fed.infer.zigzag.Preconditioner` asked for, or ``None``."""
        if self.preconditioner is None:
            return None
        if (
            isinstance(self.preconditioner, str)
            and self.preconditioner == "auto"
            and not (self.mode_search is not None and self.mode_search.is_mode)
        ):
            return None  # no mode: no Laplace approximation (the chain runs in x)
        if isinstance(self.preconditioner, str):
            return laplace_preconditioner(
                flat_potential, self.reference_point, diagonal=self.preconditioner == "diagonal", hessian=hessian
            )
        return user_preconditioner(self.preconditioner, self.reference_point, d, dtype)
