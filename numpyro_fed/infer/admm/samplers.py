"""The decentralized samplers as NumPyro MCMC kernels: D-ADMMS, its noise-free
counterpart and the paper's gradient baselines.

Each class is a thin :class:`~numpyro_fed.infer.admm.face.DecentralizedKernel` over a pure
core (:mod:`~numpyro_fed.infer.admm.dadmms`, :mod:`~numpyro_fed.infer.admm.gradient`: an
``init`` and an agent program): it checks its arguments, warns about step sizes that are
unstable at the starting point, and returns the core from
:meth:`~numpyro_fed.infer.admm.face.DecentralizedKernel.build_core`.
The baselines' defaults are the paper's hyper-parameters for its linear regression (Section
6.2.2); its logistic regression (Section 6.3.2) uses ``eta = 0.0003`` (D-SGLD) and
``eta = 0.02, gamma = 30`` (D-SGHMC).
"""

from __future__ import annotations

import warnings

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed._checks import check_int, check_positive, check_real, warn_user
from numpyro_fed.infer.admm.auto import NOISE_SCALE, PAPER_RHO, RUNAWAY_ADVICE, auto_setup
from numpyro_fed.infer.admm.dadmms import ADMMInfo, build_program, init, quadratic_potentials
from numpyro_fed.infer.admm.face import DecentralizedKernel
from numpyro_fed.infer.admm.gradient import (
    GradientInfo,
    build_dsghmc_program,
    build_dsgld_program,
    build_dula_program,
    init_dsghmc,
    init_dsgld,
    init_dula,
    largest_curvatures,
)
from numpyro_fed.infer.admm.topology import metropolis_weights
from numpyro_fed.infer.kernel import RunCheck
from numpyro_fed.infer.modes import second_start

__all__ = ["ADMM", "DADMMS", "DSGHMC", "DSGLD", "DULA"]

_SOLVERS = ("auto", "quadratic", "newton")


class DADMMS(DecentralizedKernel):
    """Distributed ADMM-based sampler (D-ADMMS, Tzikas et al. 2024) as a NumPyro
    :class:`~numpyro.infer.mcmc.MCMCKernel`.

    One agent per client of the model's :class:`~numpyro_fed.federated_plate`; agent ``i``
    knows only its client's potential plus its share of the prior and talks only to its
    neighbors in ``topology``. One MCMC sample is one iteration of all agents, reported as
    the iterate of agent ``agent`` (0 by default): ``MCMC.get_samples()[site]`` has shape
    ``(num_samples, *site_shape)``, as for any NumPyro sampler, so
    :class:`~numpyro.infer.Predictive`, ``MCMC.print_summary()`` and
    :func:`~numpyro_fed.to_inference_data` work on it unchanged. :meth:`agent_draws` gives any
    agent's draws (or all of them) and :meth:`network_average` the average of the agents'
    iterates, a diagnostic of consensus that is narrower than the posterior. As in the paper,
    independent chains (``num_chains``, best with ``chain_method="vectorized"``) are
    independent runs of the network, and the law of the iterates across chains approaches
    D-ADMMS's limit as the iterations go on; ``num_warmup`` iterations are discarded.

    D-ADMMS is biased: the limit is not the posterior. At a fixed ``rho`` its spread depends
    on ``rho`` and on the posterior's scale, so on the units of the covariates (see the guide,
    "What a sample is": on a Gaussian posterior with 250 rows the iterates' sd is about 0.7 of
    the posterior's at ``rho = 5``, and 0.03-0.4 on published regressions with raw
    covariates). The default ``rho="auto"`` runs the algorithm in the posterior's units: a
    set-up finds the MAP and the sum of the agents' Hessians there (rounds in which every
    agent sends its potential's value, gradient and Hessian at the current point, in the
    ledger as ``"DADMMS/laplace"``), the agents iterate ``y`` with ``x = MAP + L^-T y``
    (``H = L L^T``), ``rho`` is set for mixing and the noise is scaled so that, on the
    linearized recursion (its discrete Lyapunov equation), the reporting agent's stationary
    sd is the posterior's (see :mod:`~numpyro_fed.infer.admm.scaling`). The draws are then the
    same in any units of the covariates. Without a mode, where the set-up's search ran away (a
    centred hierarchy's funnel), it warns and scales the agents at a point of the posterior's
    bulk with the network's average at temperature one (the guide, "Models without a mode");
    otherwise (an improper posterior) it warns and runs the paper's ``rho = 5``. The end-of-run check warns
    when a coordinate's sd is off by more than a factor 1.4, with the measured ratio.

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`.
    :param topology: ``"ring"`` (default), ``"complete"``, ``"star"``, ``"none"``, an
        adjacency matrix or a networkx graph, one node per client (see
        :func:`~numpyro_fed.infer.admm.topology.make_topology`).
    :param rho: ADMM penalty: ``"auto"`` (default; see above: in the posterior's units,
        :attr:`rho_used` and :attr:`noise_scale_used` give what ran) or a float (> 0) in the
        model's units, the paper's algorithm as written (the paper uses 5).
    :param str solver: proximal solver: ``"auto"`` (closed form if every local potential
        is detected to be quadratic, else Newton), ``"quadratic"`` (closed form; an error if
        a potential is not quadratic) or ``"newton"``.
    :param float tolerance: Newton's step tolerance (default ``1e-10`` in float64, ``1e-5``
        in float32).
    :param int max_inner_iterations: Newton's iteration cap per proximal step.
    :param prior_weights: shares of the prior per agent (default ``1/N`` each, Eq. (27)).
    :param float init_scale: the agents start at ``N(0, init_scale^2 I)`` on the
        unconstrained space (the paper: ``N(0, I)``; with ``rho="auto"``, in the posterior's
        units: ``init_scale`` times the Laplace approximation's sd around the MAP), unless
        ``init_params`` is given to ``MCMC.run`` (by site, shaped as the site or with a
        leading agent axis).
    :param float noise_scale: multiplies the proximal noise (1: D-ADMMS; 0: C-ADMM, see
        :class:`ADMM`). ``None`` (default): 1 at a fixed ``rho``; with ``rho="auto"``,
        calibrated with ``rho`` (given with ``rho="auto"``, ``rho`` is calibrated instead:
        ``noise_scale=1.0`` is the paper's algorithm in the posterior's units, which mixes
        slower). Calibrated, the noise is also shaped (:attr:`noise_shape_used`, ``(d, d)`` in
        the posterior's whitened units) where the agents' Hessians are not proportional (each
        holds a different share of the curvature in different directions, as when clients
        hold different ranges of a covariate), so that the reporting agent's stationary
        covariance is the posterior's in every direction on a Gaussian posterior
        (:func:`~numpyro_fed.infer.admm.scaling.calibrated_noise`).
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param int agent: the agent whose iterates are the MCMC samples (default 0).
    :param federation: where the agents run: ``None`` or
        :class:`~numpyro_fed.federation.InProcess` (this process, every agent ``vmap``-ped:
        the default), or a :class:`~numpyro_fed.RayFederation` (one actor per agent holding
        its own rows only; each actor runs its own loop and sends its iterate to its
        neighbors' actors directly, the driver collects the draws and relays nothing). Both
        draw the same numbers: agent ``i``'s noise of iteration ``t`` comes from its own key
        ``fold_in(fold_in(rng_key, i), t)``. On Ray, run under ``with federation.guard():``
        so that a dead or silent agent raises a
        :class:`~numpyro_fed.federation.NetworkError` (a ``ClientError``)
        naming it, with the state to resume from (see the guide, "Run across machines").
        **Deployment**: given a federation with ``loader=`` and ``num_clients=``
        (``nf.RayFederation(loader=load, num_clients=N)``), each agent loads its own rows
        with ``load(i)`` where it lives and ``MCMC.run(rng_key)`` takes no data arguments; the
        set-up questions (is each potential quadratic) are answered by the agents, each agent
        factors its own closed-form step, and the driver never holds a row.

    Diagnostics per agent and iteration (``extra_fields``, and ``sample_stats`` of
    :func:`~numpyro_fed.to_inference_data`): ``primal_residual``, ``dual_residual``,
    ``inner_iterations``, ``converged``, and the ledger of the exchange,
    ``messages_to_peer`` and ``bytes_to_peer`` (each agent's cumulative count of what it sent
    its neighbors: its iterate, ``d`` floats, to each neighbor once to start and once per
    iteration). :meth:`check_run` warns about proximal steps that did not converge.

    **Example**

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
    ...     with nf.federated_plate("data", y.shape[0], clients=5):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> y = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (100,))
    >>> mcmc = MCMC(nf.DADMMS(model, topology="ring"), num_warmup=0, num_samples=30,
    ...             num_chains=50, chain_method="vectorized", progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(1), y)
    >>> mcmc.get_samples()["mu"].shape  # agent 0's draws: 50 chains x 30 iterations
    (1500,)
    >>> nf.DADMMS.agent_draws(mcmc)["mu"].shape, nf.DADMMS.agent_draws(mcmc, 3)["mu"].shape
    ((1500, 5), (1500,))
    >>> nf.DADMMS.network_average(mcmc)["mu"].shape
    (1500,)
    >>> final = mcmc.get_samples(group_by_chain=True)["mu"][:, -1]  # agent 0, last iteration
    >>> bool(abs(final.mean() - y.mean()) < 0.1)
    True
    >>> from numpyro.infer import Predictive
    >>> Predictive(model, mcmc.get_samples())(jax.random.PRNGKey(2), y)["y"].shape
    (1500, 100)
    """

    info_names = ADMMInfo._fields
    #: the end-of-run check warns outside a factor 1.4 in sd (what ``rho="auto"`` aims at) or
    #: past 0.3 posterior sds in mean: Stein's mean offset is zero in expectation under the
    #: posterior whatever its shape, and its Monte Carlo error is about ``1/sqrt(ESS)`` (0.05
    #: at the ESS of 20 chains of 100 draws), so 0.3 sd is a bias, not noise (a HalfCauchy
    #: scale on 32 rows of raw covariates ends 0.5 sd low)
    spread_tolerance = 1.4
    offset_tolerance = 0.3
    divergence_advice = (
        "the proximal steps have no step size to lower: look for a potential that is not "
        "finite at the iterates (e.g. an improper or non-convex model), or raise rho"
    )

    def __init__(
        self,
        model,
        *,
        topology="ring",
        rho: float | str = "auto",
        solver: str = "auto",
        tolerance: float | None = None,
        max_inner_iterations: int = 50,
        prior_weights=None,
        init_scale: float = 1.0,
        noise_scale: float | None = None,
        partition=None,
        agent: int = 0,
        federation=None,
    ):
        super().__init__(
            model,
            topology=topology,
            prior_weights=prior_weights,
            init_scale=init_scale,
            partition=partition,
            agent=agent,
            federation=federation,
        )
        self.rho = rho if isinstance(rho, str) and rho == "auto" else check_positive(rho, "rho")
        #: the ``rho`` of the last run (with ``rho="auto"``: in the posterior's units) and the
        #: set-up's :class:`~numpyro_fed.infer.admm.scaling.LaplaceScaling` (``None``: none)
        self.rho_used = None
        self.scaling = None
        if solver not in _SOLVERS:
            raise ValueError(f"solver must be one of {_SOLVERS}, got {solver!r}")
        self.solver = solver
        self.tolerance = None if tolerance is None else check_positive(tolerance, "tolerance")
        self.max_inner_iterations = check_int(max_inner_iterations, "max_inner_iterations", minimum=1)
        self.noise_scale = None if noise_scale is None else check_real(noise_scale, "noise_scale")
        if self.noise_scale is not None and self.noise_scale < 0:
            raise ValueError(f"noise_scale must be >= 0, got {noise_scale}")
        self.solver_used = None
        self.noise_scale_used = None
        self.noise_shape_used = None
        #: with ``rho="auto"`` at a mode, the set-up's
        #: :func:`~numpyro_fed.infer.admm.scaling.curvature_drift` (past
        #: :data:`~numpyro_fed.infer.admm.scaling.MAX_CURVATURE_DRIFT` the run is tempered)
        self.curvature_drift = None

    def build_core(self, potentials, topology, x0):
        if potentials.num_agents == 1 and self.noise_scale != 0:
            # D-ADMMS's noise enters through the neighbor terms only: a lone agent would run
            # noise-free ADMM, an optimizer, and report the MAP as draws.
            raise ValueError(
                "DADMMS needs at least 2 clients (agents): its noise enters through the terms "
                "that tie an agent to its neighbors, so one agent alone converges to the MAP "
                "and its draws have no spread. Split the data over several clients, or use "
                "FedZigZag (exact with one client) or NUTS"
            )
        rho, self.scaling, noise_shape, self.curvature_drift = self.rho, None, None, None
        self._setup_itemsize = jnp.asarray(x0).dtype.itemsize  # the set-up's messages are in this dtype
        noise_scale = NOISE_SCALE if self.noise_scale is None else self.noise_scale
        self.divergence_advice = type(self).divergence_advice
        if rho == "auto":
            setup = auto_setup(
                type(self).__name__,
                potentials,
                x0,
                topology,
                self.agent,
                noise_scale=self.noise_scale,
                coordinate_names=self.federated_potential.coordinate_names,
                second_start=second_start(
                    self.federated_potential, self.init_strategy, jax.random.PRNGKey(0), jnp.asarray(x0).dtype
                ),
            )
            potentials, x0, rho, noise_scale = setup.potentials, setup.x0, setup.rho, setup.noise_scale
            noise_shape = setup.noise_shape
            self.scaling, self.curvature_drift = setup.scaling, setup.curvature_drift
            if setup.runaway:
                self.divergence_advice = setup.runaway + ". " + RUNAWAY_ADVICE
            if self.scaling is not None:
                self.coordinates = (self.scaling.center, self.scaling.transform, self.scaling.inverse)
        self.rho_used, self.noise_scale_used, self.noise_shape_used = rho, noise_scale, noise_shape
        quadratic = None
        if self.solver in ("auto", "quadratic"):
            quadratic = quadratic_potentials(potentials, x0)
            if quadratic is None and self.solver == "quadratic":
                raise ValueError(
                    "solver='quadratic': the agents' potentials are not quadratic (their Hessian "
                    "is not constant); use solver='newton' or 'auto'"
                )
        self.solver_used = "quadratic" if quadratic is not None else "newton"
        program = build_program(
            potentials,
            topology.degrees,
            rho,
            noise_scale=noise_scale,
            quadratic=quadratic,
            tolerance=self.tolerance,
            max_iterations=self.max_inner_iterations,
            noise_shape=noise_shape,
        )
        return init, program

    def record_setup(self, ledger) -> None:
        """``rho="auto"``'s set-up (:func:`~numpyro_fed.infer.admm.scaling.laplace_scaling`):
        per round, the point sent to each agent (``d`` floats) and its value, gradient and
        Hessian sent back (``1 + d + d^2`` floats), ``"<Sampler>/laplace"`` in the ledger."""
        if self.scaling is None:
            return
        d, rounds = self.scaling.center.size, self.scaling.rounds
        itemsize = self._setup_itemsize
        name = f"{type(self).__name__}/laplace"
        ledger.add(name, "to_client", None, messages=rounds, nbytes=rounds * d * itemsize, rounds=rounds)
        ledger.add(name, "from_client", None, messages=rounds, nbytes=rounds * (1 + d + d * d) * itemsize)

    def diagnose(self, mcmc) -> RunCheck:
        """Besides diverged iterates and draws far from the posterior (see
        :meth:`~numpyro_fed.infer.admm.face.DecentralizedKernel.diagnose`): proximal steps
        that stopped at ``max_inner_iterations`` before the tolerance.
        :meth:`check_run` returns ``(num_unconverged, num_steps)``: proximal steps over agents,
        iterations and chains.
        """
        found = super().diagnose(mcmc)
        converged = mcmc.get_extra_fields().get("info.converged")
        if converged is None:
            return RunCheck(found.problems, (0, 0))
        converged = np.asarray(converged)
        failed = int((~converged).sum())
        problems = list(found.problems)
        if failed:
            problems.append(
                f"{failed} of {converged.size} proximal steps stopped at "
                f"max_inner_iterations={self.max_inner_iterations} before the tolerance; "
                "raise max_inner_iterations or tolerance"
            )
        return RunCheck(problems, (failed, int(converged.size)))

    def get_diagnostics_str(self, state):
        return f"primal residual {float(jnp.max(state.info.primal_residual)):.3g}"


class ADMM(DADMMS):
    """Consensus ADMM (C-ADMM; D-ADMMS without noise, ``w_i = 0`` in Algorithm 1): the
    optimization baseline of the paper. On a connected graph every agent's iterate
    converges to the MAP (the minimizer of the potential on the unconstrained space).
    Same arguments as :class:`DADMMS` except ``noise_scale``; on a federation, and in
    deployment (the agents load their own rows: ``federation=nf.RayFederation(loader=load,
    num_clients=N)`` and ``MCMC.run(rng_key)`` without data), as :class:`DADMMS`.

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
    ...     with nf.federated_plate("data", y.shape[0], clients=4):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> y = jax.numpy.arange(8.0)
    >>> mcmc = MCMC(nf.ADMM(model, topology="complete", rho=1.0), num_warmup=0, num_samples=100,
    ...             progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(0), y)
    >>> bool(abs(nf.ADMM.agent_draws(mcmc)["mu"][-1] - y.sum() / (8 + 0.01)).max() < 1e-6)
    True
    """

    samples_posterior = False  # an optimizer: its iterates converge to the MAP

    def __init__(self, model, *, rho: float | str = PAPER_RHO, **kwargs):
        if "noise_scale" in kwargs:
            raise TypeError("ADMM has no noise_scale: it is D-ADMMS with noise_scale=0")
        super().__init__(model, rho=rho, noise_scale=0.0, **kwargs)

    def hyperparameters(self) -> dict:
        values = super().hyperparameters()
        values.pop("noise_scale", None)  # not an argument of ADMM
        return values


def _warn_unstable(name, potentials, x0, gain, advice):
    """Warns when ``gain(curvature) >= 1`` for the stiffest agent at the starting point: the
    linearized update is then unstable. On a quadratic potential the iterates then run away;
    elsewhere they may settle where the curvature is lower (e.g. logistic regression away
    from zero), so this is a warning, and :meth:`check_run` reports runs that did diverge."""
    curvatures = np.asarray(largest_curvatures(potentials, x0))
    if not np.all(np.isfinite(curvatures)):
        return
    agent = int(np.argmax(curvatures))
    curvature = float(curvatures[agent])
    if gain(curvature) >= 1.0:
        warn_user(
            f"{name}: the largest curvature of an agent's potential at the starting point is "
            f"{curvature:.3g} (agent {agent}); with these step sizes the update linearized there is "
            f"unstable, so the iterates may run away (they do on a Gaussian model): {advice(curvature)}",
            RuntimeWarning,
        )


class DSGLD(DecentralizedKernel):
    """Decentralized SGLD (Eq. (22)) with Metropolis weights, as an ``MCMCKernel``.

    :param float step_size: ``eta`` (the paper: 0.009 for linear regression, 0.0003 for
        logistic regression).

    Other arguments (``topology``, ``prior_weights``, ``init_scale``, ``partition``,
    ``agent``, ``federation``) and the output are those of :class:`~numpyro_fed.DADMMS`: on a
    :class:`~numpyro_fed.RayFederation` each agent is an actor that sends its iterate to its
    neighbors' actors directly. In deployment (``federation=nf.RayFederation(loader=load,
    num_clients=N)``, ``MCMC.run(rng_key)`` without data) each agent loads its own rows where
    it lives and answers the step-size check (its potential's largest curvature at the start,
    one number) from them; the driver never holds a row.

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
    ...     with nf.federated_plate("data", y.shape[0], clients=4):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> mcmc = MCMC(nf.DSGLD(model, topology="ring"), num_warmup=0, num_samples=20, progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(0), jax.numpy.zeros(40))
    >>> mcmc.get_samples()["mu"].shape, nf.DSGLD.agent_draws(mcmc)["mu"].shape
    ((20,), (20, 4))
    """

    info_names = GradientInfo._fields

    def __init__(
        self,
        model,
        *,
        topology="ring",
        step_size: float = 0.009,
        prior_weights=None,
        init_scale: float = 1.0,
        partition=None,
        agent: int = 0,
        federation=None,
    ):
        super().__init__(
            model,
            topology=topology,
            prior_weights=prior_weights,
            init_scale=init_scale,
            partition=partition,
            agent=agent,
            federation=federation,
        )
        self.step_size = check_positive(step_size, "step_size")

    @property
    def divergence_advice(self):
        return f"lower step_size (now {self.step_size:g})"

    def build_core(self, potentials, topology, x0):
        # x' = x - eta f''(x) x on the consensus direction: stable for eta * curvature < 2
        _warn_unstable(
            "DSGLD",
            potentials,
            x0,
            lambda c: self.step_size * c / 2.0,
            lambda c: f"use step_size below {2.0 / c:.2g} (now {self.step_size:g}), e.g. {0.2 / c:.2g}",
        )
        program = build_dsgld_program(potentials, metropolis_weights(topology.adjacency), self.step_size)
        return init_dsgld, program


class DSGHMC(DecentralizedKernel):
    """Decentralized SGHMC (Eqs. (23)-(24)) with Metropolis weights, as an ``MCMCKernel``.

    :param float step_size: ``eta`` (the paper: 0.1 for linear, 0.02 for logistic regression).
    :param float friction: ``gamma`` (the paper: 7 for linear, 30 for logistic regression).

    Momenta start at zero. Other arguments, federations and deployment (agents that load
    their own rows) as :class:`DSGLD`.
    """

    info_names = GradientInfo._fields

    def __init__(
        self,
        model,
        *,
        topology="ring",
        step_size: float = 0.1,
        friction: float = 7.0,
        prior_weights=None,
        init_scale: float = 1.0,
        partition=None,
        agent: int = 0,
        federation=None,
    ):
        super().__init__(
            model,
            topology=topology,
            prior_weights=prior_weights,
            init_scale=init_scale,
            partition=partition,
            agent=agent,
            federation=federation,
        )
        self.step_size = check_positive(step_size, "step_size")
        self.friction = check_positive(friction, "friction")

    @property
    def divergence_advice(self):
        return f"lower step_size (now {self.step_size:g})"

    def build_core(self, potentials, topology, x0):
        # the scalar linearization (v, x) -> ((1 - eta gamma) v - eta c x, x + eta v') is stable
        # iff eta gamma < 2 and eta^2 c < 2 (2 - eta gamma) (Jury's conditions)
        eta, gamma = self.step_size, self.friction
        _warn_unstable(
            "DSGHMC",
            potentials,
            x0,
            lambda c: max(eta * gamma / 2.0, eta**2 * c / max(2.0 * (2.0 - eta * gamma), 1e-300)),
            lambda c: (
                f"lower step_size (now {eta:g}) so that step_size * friction < 2 and "
                f"step_size^2 * {c:.3g} < 2 (2 - step_size * friction)"
            ),
        )
        program = build_dsghmc_program(
            potentials, metropolis_weights(topology.adjacency), self.step_size, self.friction
        )
        return init_dsghmc, program


class DULA(DecentralizedKernel):
    """Decentralized ULA (Eq. (25)) with decaying step sizes, as an ``MCMCKernel``.

    ``alpha_k = alpha0 / (230 + k)^chi2`` and ``zeta_k = zeta0 / (230 + k)^chi1``, ``k``
    counting iterations from the start (warm-up included).

    :param float alpha0: 0.00082 in the paper.
    :param float zeta0: 0.48 in the paper.
    :param float chi1: ``None``: the paper's choice, 0.55 on a complete graph, else 0.05.
    :param float chi2: 0.05 in the paper.

    Other arguments, federations and deployment (agents that load their own rows) as
    :class:`DSGLD`.
    """

    info_names = GradientInfo._fields
    divergence_advice = "lower alpha0 or zeta0"

    def __init__(
        self,
        model,
        *,
        topology="ring",
        alpha0: float = 0.00082,
        zeta0: float = 0.48,
        chi1: float | None = None,
        chi2: float = 0.05,
        prior_weights=None,
        init_scale: float = 1.0,
        partition=None,
        agent: int = 0,
        federation=None,
    ):
        super().__init__(
            model,
            topology=topology,
            prior_weights=prior_weights,
            init_scale=init_scale,
            partition=partition,
            agent=agent,
            federation=federation,
        )
        self.alpha0 = check_positive(alpha0, "alpha0")
        self.zeta0 = check_real(zeta0, "zeta0")
        if self.zeta0 < 0:
            raise ValueError(f"zeta0 must be >= 0, got {zeta0}")
        self.chi1 = None if chi1 is None else check_real(chi1, "chi1")
        self.chi2 = check_real(chi2, "chi2")

    def build_core(self, potentials, topology, x0):
        chi1 = self.chi1
        if chi1 is None:
            chi1 = (
                0.55
                if topology.num_edges == topology.num_agents * (topology.num_agents - 1) // 2
                and topology.num_agents > 2
                else 0.05
            )
        laplacian = np.diag(topology.degrees) - topology.adjacency
        zeta = self.zeta0 / 230.0**chi1
        if topology.num_edges and zeta * np.linalg.eigvalsh(laplacian).max() >= 2.0:
            warnings.warn(
                f"DULA: the first consensus step zeta_0 / 230^chi1 = {zeta:.3g} times the largest "
                f"Laplacian eigenvalue {np.linalg.eigvalsh(laplacian).max():.3g} is >= 2, so the "
                "consensus update diverges at first; lower zeta0 or raise chi1",
                RuntimeWarning,
                stacklevel=2,
            )
        # the first gradient step alpha_0 / 230^chi2 * N * f'': stable below 2
        first = self.alpha0 / 230.0**self.chi2 * topology.num_agents
        _warn_unstable(
            "DULA",
            potentials,
            x0,
            lambda c: first * c / 2.0,
            lambda c: (
                f"lower alpha0 (now {self.alpha0:g}) below {2.0 / (c * topology.num_agents) * 230.0**self.chi2:.2g}"
            ),
        )
        program = build_dula_program(potentials, alpha0=self.alpha0, zeta0=self.zeta0, chi1=chi1, chi2=self.chi2)
        return init_dula, program
