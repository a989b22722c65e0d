"""DSVGD (Kassab & Simeone, Algorithm 1) and its variants U-DSVGD and P-DSVGD for NumPyro
models: thin faces over the cores in :mod:`~numpyro_fed.infer.stein.dsvgd`,
:mod:`~numpyro_fed.infer.stein.udsvgd` and :mod:`~numpyro_fed.infer.stein.pdsvgd`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer.initialization import init_to_sample

from numpyro_fed._checks import check_int, check_positive, warn_user
from numpyro_fed.federation.base import check_min_clients, resolve_min_clients
from numpyro_fed.infer.base import adopt_client_state, jit_round
from numpyro_fed.infer.modes import OTHER_MODE_WARNING, compare_modes, laplace
from numpyro_fed.infer.stein import dsvgd as dsvgd_core
from numpyro_fed.infer.stein import local as local_core
from numpyro_fed.infer.stein import pdsvgd as pdsvgd_core
from numpyro_fed.infer.stein import udsvgd as udsvgd_core
from numpyro_fed.infer.stein.checks import runaway_problems, stein_moments, unsettled_rounds, warn_runaway
from numpyro_fed.infer.stein.client_order import check_client_order
from numpyro_fed.infer.stein.curvature import CONVERGED_DECREMENT, newton_modes
from numpyro_fed.infer.stein.face import ParticleMethod, kernel_stein_discrepancy
from numpyro_fed.infer.stein.kde import check_kde_bandwidth
from numpyro_fed.infer.stein.moments import (
    GAUSSIAN_RESIDUAL,
    MOMENT_CORRECTION,
    MOMENT_TOLERANCE,
    can_correct,
    correction_move,
    stein_misfit,
    stein_moment_correction,
)
from numpyro_fed.infer.stein.optim import adagrad_momentum, check_optim
from numpyro_fed.infer.stein.whitening import whitening
from numpyro_fed.infer.zigzag.mode import OtherMode
from numpyro_fed.infer.zigzag.setup import setup_functions

__all__ = ["DSVGD", "PDSVGD", "UDSVGD"]


#: the least effective size, as a fraction of their number, of a client's importance draws of its
#: latents (:func:`~numpyro_fed.infer.stein.local.marginal_scores`) with client-local latents,
#: below which the run warns
MIN_CONDITIONAL_ESS = 0.1

#: the most halvings of a step of Stein's moment correction that fits Stein's identities worse
#: than the particles it starts from (:meth:`DSVGD._correct_moments`)
MAX_HALVINGS = 5

#: the most the last step of a restarted Stein's moment correction (:meth:`DSVGD._restart`)
#: may move a coordinate's mean, in its sds (or change its sd, as a fraction) for its
#: particles to be returned: a third of the 0.3 sd of a mean
#: the zoo's targets allow (measured on mtcars over 4 clients: the log scale's mean moved
#: 0.03 sd at step 20, converging linearly)
RESTART_TOLERANCE = 0.1

#: one step of Stein's moment correction, compiled once per shape for every run
_moment_step = jax.jit(stein_moment_correction)
_misfit = jax.jit(stein_misfit)


class ModeLaplace(NamedTuple):
    """The Laplace approximation of the posterior at the mode a run started from
    (:meth:`DSVGD._start_particles`): ``N(point, H^{-1})``, ``H = hessian_chol hessian_chol^T``."""

    point: jax.Array
    hessian_chol: jax.Array


#: the Newton decrement (squared Newton step, in posterior sds) at which the search for the
#: posterior's mode before the first round stops (:meth:`DSVGD._start_particles`)
MODE_TOLERANCE = 1e-6


class DSVGD(ParticleMethod):
    """Distributed Stein variational gradient descent (Kassab & Simeone, Algorithm 1).

    The target is the tempered global posterior (DSVGD Eq. (2))
    ``q_opt(theta) ∝ p_0(theta) exp(-(1/alpha) sum_k L_k(theta))`` on the unconstrained latent
    space, ``L_k`` client ``k``'s term of :func:`~numpyro_fed.split_potential`. The server
    holds ``N`` global particles; client ``k`` holds ``N`` local particles whose KDE encodes
    its approximate likelihood ``t_k``. In each round the scheduled client downloads the global
    particles, runs ``L`` SVGD steps towards its tilted distribution (Eq. (14)), uploads the
    result and distills its local particles with ``L'`` steps (Eq. (17)).

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`. Its latent
        variables may be global (outside the federated plates) or client-local (inside a
        federated plate, e.g. a school's effect owned by the client holding the school): then
        each client moves joint particles ``(theta, z_k)``, keeps their ``z_k`` halves as its
        client state and sends only ``theta`` (:mod:`~numpyro_fed.infer.stein.local`); after the
        rounds each client gives the gradient of its term with its latents integrated out at
        the global particles (a ``"marginal_score"`` call, for Stein's check and moment
        correction), and :meth:`get_samples` fetches draws of the local sites given the global
        particles from the clients (a ``"draw_latents"`` call), both counted in the ledger. A
        client's rows must use only its own local latents.
    :param int num_particles: ``N`` (>= 1), global and local particles alike.
    :param int num_local_steps: ``L``, SVGD steps of a scheduled client towards its tilted
        distribution.
    :param int num_distill_steps: ``L'``, distillation steps on the client's local particles.
    :param float learning_rate: of the default optimizer,
        :func:`~numpyro_fed.infer.stein.optim.adagrad_momentum` (the paper's Table 3: 0.05 for
        logistic regression, 0.001 for BNNs).
    :param optim: an optax ``GradientTransformation`` for the ``L`` steps, overriding
        ``learning_rate``; its state is reset every round.
    :param distill_optim: the same for the ``L'`` steps (default: ``optim``).
    :param kde_bandwidth: ``"auto"`` (default): every round runs in the coordinates that
        whiten the global particles it starts from (their mean and covariance, or
        per-coordinate standard deviations when ``N <= 2 d``); its KDEs keep the mean and
        variance of their particles (kernel: 0.85 of their standard deviation); its SVGD
        loops re-whiten their particles in four stages. The run does not depend on the units
        of the parameters (exactly, up to rounding, for a change of units ``a x + b`` per
        coordinate). With global latents only, a client's local particles encode its factor
        times a carrier that keeps it proper, and an old factor that would make the round's
        target improper enters it damped (:mod:`~numpyro_fed.infer.stein.cavity`). A float:
        the paper's algorithm as published, a Gaussian KDE kernel of that standard deviation
        in the model's unconstrained coordinates (the paper: 0.55); its results depend on the
        units.
    :param svgd_bandwidth: bandwidth ``h`` of the SVGD kernel ``exp(-|x - y|^2 / h)`` (in the
        whitened coordinates with ``kde_bandwidth="auto"``); ``None`` (default): ``2 med^2``
        with ``kde_bandwidth="auto"``, the median heuristic ``med^2 / log N`` with a fixed
        ``kde_bandwidth``.
    :param float temperature: ``alpha`` of the free energy (1: Bayes' posterior).
    :param client_order: ``"round_robin"`` (default), ``"random"`` (a uniformly random client
        per round, from the run's key) or a sequence of client indices, one per round.
    :param dict metrics: ``{name: fn}`` evaluated on the global particles after every round
        (see :class:`~numpyro_fed.infer.stein.face.ParticleMethod`).
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: NumPyro init strategy of the initial particles, run once per
        particle; default ``init_to_sample``: prior draws (Algorithm 1, line 1) and, where the
        prior cannot be sampled (flat ``ImproperUniform`` priors), NumPyro's uniform ``(-2,
        2)`` on the unconstrained space. With ``kde_bandwidth="auto"`` and global latents,
        the particles' mean first moves to the posterior's mode (the one with the larger
        Laplace mass where a search from two starts finds two; :meth:`_start_particles`), and
        the first round starts from the Laplace approximation of its target.
    :param bool progress_bar: a progress bar over rounds.
    :param int batch_size: rows of the client's data per SVGD step (drawn afresh at every
        step, without replacement, the gradient scaled by ``n_k / batch_size``), as in the
        paper's experiments (Table 2: 100 for the regression BNNs); ``None`` (default): all
        of them. Needs a model with one federated data plate.
    :param int min_clients: ``None`` (default): every scheduled client must answer; one that
        fails or times out stops the run with a :class:`~numpyro_fed.federation.ClientError`
        whose ``state`` resumes it. An int: a round whose scheduled client fails is skipped
        (the global particles and its local particles stay as they were, the analogue of
        PVI's unchanged factor; ``metrics["participated"]`` records it) and the client
        rejoins at its next scheduled round from its client state; the run stops with the
        ``ClientError`` only when fewer than ``min_clients`` clients are in (those whose last
        scheduled round answered, or not scheduled yet). DSVGD only (not its variants). The
        guide's *Nodes that drop out*.
    :param int moment_correction: ``None`` (default): up to 20 with ``kde_bandwidth="auto"``
        (:data:`~numpyro_fed.infer.stein.moments.MOMENT_CORRECTION`), 0 with a fixed bandwidth
        (and in U-DSVGD, whose clients keep the global iterates). The most corrections of the
        last round's global particles once every client has been scheduled
        (:func:`~numpyro_fed.infer.stein.moments.stein_moment_correction`), stopping after one
        that moves every mean by less than 0.01 sd and every sd by less than 1 %
        (:data:`~numpyro_fed.infer.stein.moments.MOMENT_TOLERANCE`): each asks every client for
        its full-batch gradient at the particles (the ``"potential_grad"`` call of Stein's
        check; with client-local latents, the gradient of its marginal term, its
        ``"marginal_score"`` call) and moves them by the affine map that gives them the mean
        and covariance of the Gaussian whose score best fits the target's in least squares,
        keeping their shape; a step whose particles fit Stein's identities worse
        (:func:`~numpyro_fed.infer.stein.moments.stein_misfit`) is halved, up to 5 times. Exact
        for a Gaussian posterior; consistent for any posterior the particles follow in shape.
        Where the rounds ran away (the correction does not settle, or Stein's check of the
        particles it settles on still fails) or, with global latents, diverged, the
        correction restarts from the Laplace approximation at the posterior's mode the run
        started from (global latents), then from the particles at the end of the first pass
        over the clients, and the first restart whose particles pass the check is returned,
        with a warning that they are not the rounds' (otherwise the rounds' particles and the
        warning, or the ``FloatingPointError``; :meth:`_restart`). Needs
        ``N > d + 1`` (``d``: the global coordinates; otherwise not applied). 0: the particles
        of the rounds, as in the paper. The DSVGD guide, *Stein's moment correction* and
        *When the rounds run away*.
    :param federation: where the clients run: ``None`` (the default: in this process) or a
        :class:`~numpyro_fed.federation.Federation` such as :class:`~numpyro_fed.RayFederation`
        (each client a worker holding only its own rows); same key, same answer. Each round
        the server sends the scheduled client the ``N`` global particles (and whether ``q`` is
        still the prior; with ``batch_size``, the round's key for its minibatches) and the
        client returns ``N`` new global particles, as in the paper: its local particles are
        its client state (:class:`~numpyro_fed.federation.ClientState`), kept where it lives
        and never sent (on Ray, on its worker; in process, in ``result.state.clients``).
        ``result.ledger`` counts it, and the diagnostics' ``"potential_grad"`` calls
        (Stein's checks, :meth:`evaluate`) and the start's mode search (``"potential_grad"``,
        ``"hessian"`` and ``"value_and_grad"`` calls of one point each). A client
        that dies or stops answering stops the run with a
        :class:`~numpyro_fed.federation.ClientError` whose ``state`` resumes it, unless
        ``min_clients`` lets the run go on without it.
        **Deployment**: given a federation with ``loader=`` (e.g.
        ``nf.RayFederation(loader=load, num_clients=M)``), each client loads its own rows
        where it lives and the run takes no data arguments, ``DSVGD(model,
        federation=fed).run(rng_key, num_rounds)``: the driver never holds a row (the prior
        draws run the model on zero stand-ins of the rows).

    **Results.** ``run`` returns a :class:`~numpyro_fed.infer.RunResult` whose ``state`` is a
    :class:`~numpyro_fed.infer.stein.dsvgd.DSVGDState` (:meth:`particles` gives its global
    particles). DSVGD defines no loss: ``result.metrics`` holds per round ``client``, ``move``
    (root mean square move of the global particles), ``participated`` (``(K,)`` bool: the
    scheduled client, if its update was applied), ``particles`` (the global particles),
    ``wall_time``, the user's metrics and Stein's checks below; :meth:`evaluate` gives the
    kernel Stein discrepancy of a state's particles.

    **Checks.** Non-finite particles stop the run with a :class:`FloatingPointError`. Once
    every client has been scheduled, each round also checks the global particles against
    Stein's identity for the target ``p``: ``E_p[d log p / d x_j] = 0`` and
    ``E_p[(d log p / d x_j) (x_j - m_j)] = -1``. With the full-batch score,
    ``result.metrics`` records per round and coordinate ``stein_mean`` (the mean score through
    the particles' covariance over their sd: 0 expected; see
    :func:`~numpyro_fed.infer.stein.checks.stein_statistics`) and ``stein_scale`` (1 expected;
    for a Gaussian target, the ratio of the particles' variance to the posterior's). After
    the last round, a mean more than 0.3 posterior sds off by that measure, ``stein_scale``
    outside ``[1/1.5^2, 1.5^2]`` (the limits of agreement with a reference), or (in a run
    from the init strategy's draws) a spread or a distance from them of more than 1000 of
    their sds, is reported by a :class:`RuntimeWarning` that names what to change. With
    ``moment_correction``, the last round's statistics are those of the corrected particles
    (what :meth:`get_samples` returns; ``metrics["moment_residual"]`` holds the fraction of
    the score's variance its linear fit left), and a failed check of the uncorrected
    particles still warns where that fraction exceeds 0.05 (the target is then not close to
    Gaussian over the particles).

    **Example**

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 3), obs=y)
    >>> y = jnp.array([0.5, 1.5, 2.0, 4.0])
    >>> dsvgd = nf.DSVGD(model, num_particles=20, num_local_steps=100, num_distill_steps=100,
    ...                  progress_bar=False)
    >>> result = dsvgd.run(jax.random.PRNGKey(0), 4, y)
    >>> draws = dsvgd.get_samples(jax.random.PRNGKey(1), result, 1000)
    >>> draws["mu"].shape, result.metrics["client"].tolist()
    ((1000,), [0, 1, 0, 1])
    >>> abs(float(draws["mu"].mean()) - 8.0 / (4 + 1)) < 0.3  # exact posterior mean 1.6
    True
    """

    repr_fields = (
        "num_particles",
        "num_local_steps",
        "num_distill_steps",
        "kde_bandwidth",
        "temperature",
        "client_order",
        "batch_size",
        "moment_correction",
    )

    def __init__(
        self,
        model,
        *,
        num_particles: int = 20,
        num_local_steps: int = 400,
        num_distill_steps: int = 400,
        learning_rate: float = 0.05,
        optim=None,
        distill_optim=None,
        kde_bandwidth: float | str = "auto",
        svgd_bandwidth: float | None = None,
        temperature: float = 1.0,
        client_order="round_robin",
        metrics: Mapping[str, Callable] | None = None,
        partition=None,
        init_strategy=init_to_sample,
        progress_bar: bool = True,
        batch_size: int | None = None,
        federation=None,
        min_clients: int | None = None,
        moment_correction: int | None = None,
    ):
        super().__init__(
            model,
            num_particles=num_particles,
            metrics=metrics,
            partition=partition,
            init_strategy=init_strategy,
            progress_bar=progress_bar,
            temperature=temperature,
            batch_size=batch_size,
            federation=federation,
        )
        self.num_local_steps = check_int(num_local_steps, "num_local_steps", minimum=1)
        self.num_distill_steps = check_int(num_distill_steps, "num_distill_steps", minimum=0)
        self.learning_rate = check_positive(learning_rate, "learning_rate")
        self.optim = adagrad_momentum(self.learning_rate) if optim is None else check_optim(optim, "optim")
        self.distill_optim = self.optim if distill_optim is None else check_optim(distill_optim, "distill_optim")
        self.kde_bandwidth = check_kde_bandwidth(kde_bandwidth)
        self.svgd_bandwidth = None if svgd_bandwidth is None else check_positive(svgd_bandwidth, "svgd_bandwidth")
        self.client_order = check_client_order(client_order)
        self.min_clients = check_min_clients(min_clients)
        if moment_correction is None:
            moment_correction = MOMENT_CORRECTION if self.kde_bandwidth == "auto" and self.corrects_moments else 0
        self.moment_correction = check_int(moment_correction, "moment_correction", minimum=0)
        if self.min_clients is not None and type(self) is not DSVGD:
            raise ValueError(
                f"min_clients={min_clients}: {type(self).__name__} does not skip clients that drop out; "
                "DSVGD does (or pass min_clients=None: every client must answer)"
            )

    local_latents = True
    _layout = None  # the LatentLayout of a model with client-local latents
    #: the mode the particles did not start at, where the search before the first round found
    #: two (:meth:`_start_particles`); ``None`` otherwise
    other_mode: OtherMode | None = None
    #: whether ``moment_correction=None`` means :data:`~numpyro_fed.infer.stein.moments.MOMENT_CORRECTION`
    #: corrections with ``kde_bandwidth="auto"`` (U-DSVGD: 0, its clients keep the global iterates)
    corrects_moments = True

    @property
    def divergence_advice(self) -> str:
        """What to change when the particles turn non-finite: the step size, and with
        client-local latents the parametrisation (measured: a centred hierarchy diverges), and
        where a client holds fewer rows than the model has coordinates, the split."""
        if self._layout is None:
            return self._small_clients_advice() or "lower learning_rate"
        sites = ", ".join(f"'{s}'" for s in self._layout.local_sites)
        return (
            f"with client-local latents ({sites}): if the model is a centred hierarchy (a local effect drawn "
            "as Normal(mu, sigma) with its scale sigma a global latent), each client's joint target is a funnel "
            "that DSVGD's joint particles cannot follow: write it non-centred (draw the effect as "
            "Normal(0, 1) and use mu + sigma * effect), as in eight schools; otherwise lower learning_rate"
        )

    def _small_clients_advice(self) -> str | None:
        """What to change where a client holds fewer rows than the particles have coordinates
        (its term alone is then flat in some directions, and its local steps run along them:
        measured on mtcars' 32 rows over 8 clients, where a lower learning_rate did not
        help); ``None`` elsewhere."""
        sizes = getattr(getattr(self, "federated_potential", None), "client_sizes", None)
        if sizes is None or not 0 < int(np.min(sizes)) < self._state_dim():
            return None
        return (
            f"a client holds {int(np.min(sizes))} rows for {self._state_dim()} unconstrained coordinates, so its "
            "term alone leaves directions that only the prior bounds and its local steps can run far along them "
            "(a lower learning_rate does not help there): use fewer, larger clients, or DPPVI or FedZigZag"
        )

    def particles(self, state):
        return state.global_particles

    def initial_state(self, particles, num_rounds=None):
        if self._layout is not None:
            return local_core.init(particles, self._layout, self._active_federation)
        return dsvgd_core.init(particles, self._active_federation, carrier=self.kde_bandwidth == "auto")

    # -- client-local latents (see numpyro_fed.infer.stein.local) ------------------------------
    def _configure(self, fp):
        self._layout, self._client_calls = local_core.latent_layout(fp), {}
        if self._layout is None:
            return
        if self.batch_size is not None:
            raise ValueError(
                f"batch_size needs a model whose latent variables are all global; site(s) "
                f"{list(self._layout.local_sites)} are client-local: pass batch_size=None"
            )
        local_core.check_own_latents(fp, self._layout, self.gradients.client_grad, fp.ravel(fp.init_params))

    def _state_dim(self):
        return super()._state_dim() if self._layout is None else self._layout.num_global

    # -- the start: one mode of two (see _start_particles) -------------------------------------
    def _searches_modes(self) -> bool:
        return self._layout is None and self.kde_bandwidth == "auto"

    def _setup_functions(self, fp) -> dict:
        """The mode search's ``"value_and_grad"`` and ``"hessian"`` calls (FedZigZag's, of the
        client's term at one point)."""
        return setup_functions(fp.flat().client_potential) if self._searches_modes() else {}

    def _mode_search(self, starts, w, federation):
        """:meth:`_start_particles`' search, ``(ends, decrements, masses, sds, chols)``: Newton
        from ``starts`` (``(2, d)``) in the coordinates ``w`` whitens to (a
        :class:`~numpyro_fed.infer.stein.whitening.Whitening`), then each end's Laplace log
        mass (``-U - log det(H) / 2``; ``-inf`` without a mode), sds and the Cholesky factor of
        its Hessian ``H``."""
        prior, temperature = self.federated_potential.flat().prior_potential, self.temperature
        score = self._target_score(federation)

        def hessian(x):  # of the tempered potential, prior + sum_k L_k / alpha
            return jax.hessian(prior)(x) + jnp.sum(federation.map("hessian", x), axis=0) / temperature

        def log_mass(x):
            values, _ = federation.map("value_and_grad", x)
            approx = laplace(prior(x) + jnp.sum(values) / temperature, hessian(x))
            ok = jnp.all(jnp.isfinite(approx.chol)) & jnp.isfinite(approx.log_mass)
            return jnp.where(ok, approx.log_mass, -jnp.inf), approx.sd, approx.chol

        def score_z(z):
            return w.score_to_z(score(w.from_z(z)))

        def hessian_z(z):  # chol^T H chol
            return w.score_to_z(w.score_to_z(hessian(w.from_z(z))).T)

        ends, decrements = newton_modes(score_z, w.to_z(starts), hessian_fn=hessian_z, tolerance=MODE_TOLERANCE)
        ends = w.from_z(ends)
        masses, sds, chols = jax.lax.map(log_mass, ends)
        return ends, decrements, masses, sds, chols

    def _start_particles(self, particles):
        """The particles drawn from the init strategy, moved (their mean, not their spread) to
        the posterior's mode, the one with the larger Laplace mass where it has two.

        The first round starts from the Laplace approximation of the first client's own
        posterior, found by Newton's method from the particles' mean
        (:func:`~numpyro_fed.infer.stein.curvature.laplace_start`), and the rounds stay near
        the mode they start at: on a two-component mixture split over 8 clients, from the
        prior's draws, that was the label-swapped mode, where the posterior holds far less mass.
        Before the first round the server looks for the posterior's mode with the same Newton
        iteration (:func:`~numpyro_fed.infer.stein.curvature.newton_modes`, in the coordinates
        that whiten the particles, until its step is 0.001 posterior sds) from the particles'
        mean and from the origin of the unconstrained space (the first round's two starts),
        asking the clients for their terms' gradients (``"potential_grad"``), Hessians
        (``"hessian"``) and values (``"value_and_grad"``, at the two ends), calls in the run's
        ledger: three round trips a Newton step. Of two separated modes
        it takes the one with the larger Laplace mass
        (:func:`~numpyro_fed.infer.modes.compare_modes`; :attr:`other_mode` records the other).
        Where the other holds at least 1% of the mass
        (:data:`~numpyro_fed.infer.modes.OTHER_MODE_WARNING`) a :class:`RuntimeWarning` says so.
        Where neither search ends at a mode the particles stay as drawn. With global latents
        and ``kde_bandwidth="auto"`` only."""
        self.other_mode, self._start_ledger = None, {}
        if not self._searches_modes():
            return particles
        mean = jnp.mean(particles, axis=0)
        starts, w = jnp.stack([mean, jnp.zeros_like(mean)]), whitening(particles)
        if self._start_search is None:  # compiled once per split of the model, for every run
            self._start_search = jit_round(self._mode_search)
        federation = self._active_federation
        search = self._start_search
        ends, decrements, masses, sds, chols = self.through_clients(
            lambda: search(starts, w, federation), self._start_ledger
        )
        modes = [
            (ends[i], sds[i], masses[i], chols[i])
            for i in range(len(starts))
            if decrements[i] <= CONVERGED_DECREMENT and np.isfinite(masses[i])
        ]
        if not modes:
            return particles
        mode = modes[0]
        if len(modes) == 2:
            found = compare_modes(*(m[:3] for m in modes))
            if found is not None:
                mode, other = modes[::-1] if found.take_second else modes
                self.other_mode = OtherMode(jnp.asarray(other[0]), -float(other[2]), found.share, found.distance)
                if found.share >= OTHER_MODE_WARNING:
                    warn_user(
                        f"{type(self).__name__}: the posterior has at least two modes: searches from two starts "
                        f"found modes {found.distance:.3g} Laplace sds apart, and by their Laplace approximations "
                        f"the other holds {found.share:.1%} of the mass. The particles start at the larger, and "
                        "the rounds stay near the mode they start from, so the draws may miss the other: compare "
                        "runs from init_particles at each (other_mode.point), or reparametrize (e.g. order a "
                        "mixture's components)",
                        RuntimeWarning,
                    )
        self._mode_laplace = ModeLaplace(jnp.asarray(mode[0], particles.dtype), jnp.asarray(mode[3], particles.dtype))
        return particles + (jnp.asarray(mode[0], particles.dtype) - mean)

    def _client_call(self, name: str):
        """The stateful call ``name`` of the clients on the global particles, compiled once:
        ``(global_particles, clients, *extra) -> replies`` (stacked by client; ``extra``:
        more arguments every client gets)."""
        if name not in self._client_calls:

            def call(theta, clients, *more):
                *extra, federation = more
                return federation.map(name, theta, *extra, state=clients)[1]

            self._client_calls[name] = jit_round(call)
        federation = self._active_federation
        return lambda theta, clients, *extra: self._client_calls[name](theta, clients, *extra, federation)

    def joint_particles(self, state, ledger: dict | None = None):
        """The ``(N, d)`` joint particles of a state of a model with client-local latents: its
        global particles and, for each, every client's draw of its latents given it (each
        client's ``"latents"`` call, :func:`~numpyro_fed.infer.stein.local.draw_conditionals`;
        counted in the federation's ledger, and added to ``ledger`` if given)."""
        if self._layout is None:
            return self.particles(state)
        fetch = self._client_call("latents")
        latents = self.through_clients(lambda: fetch(state.global_particles, state.clients), ledger)
        return self._layout.assemble(state.global_particles, jnp.asarray(latents))

    def constrained(self, particles) -> dict:
        """Constrained values by site of ``(S, d)`` flat particles; of a model with client-local
        latents, ``(S, d_g)`` global particles give its global sites only."""
        particles, layout = jnp.asarray(particles), self._layout
        if layout is None or particles.shape[-1] == layout.num_latent:
            return super().constrained(particles)
        num_clients, width = layout.positions.shape
        full = layout.assemble(particles, jnp.zeros((num_clients, particles.shape[0], width), particles.dtype))
        return {k: v for k, v in super().constrained(full).items() if k not in layout.local_sites}

    def get_samples(self, rng_key, result, num_samples: int | None = None, *, smooth: bool = False) -> dict:
        """As :meth:`ParticleMethod.get_samples`; in a model with client-local latents, every
        site: each draw a global particle and, for the local sites, each client's draw of its
        conditional ``p(z_k | theta)`` given it (its ``"draw_latents"`` call, added to
        ``result.ledger``; :func:`~numpyro_fed.infer.stein.local.draw_conditionals`)."""
        if self._layout is None:
            return super().get_samples(rng_key, result, num_samples, smooth=smooth)
        if smooth:
            raise ValueError(
                "smooth=True draws from the KDE of the global particles; in a model with client-local latents "
                "the draws are the global particles and the clients' draws of their latents given them: pass "
                "smooth=False"
            )
        # each draw: a global particle, and every client's draw of its conditional given it
        state, theta = result.state, result.state.global_particles
        pick_key, draw_key = jax.random.split(jax.random.PRNGKey(0) if rng_key is None else rng_key)
        if num_samples is None:
            index = jnp.arange(theta.shape[0])
        else:
            num_samples = check_int(num_samples, "num_samples", minimum=1)
            index = jax.random.randint(pick_key, (num_samples,), 0, theta.shape[0])
        draw = self._client_call("draw_latents")
        latents = self.through_clients(lambda: draw(theta, state.clients, index, draw_key), result.ledger)
        return self.constrained(self._layout.assemble(theta[index], jnp.asarray(latents)))

    def evaluate(self, state, *args, **kwargs):
        """As :meth:`ParticleMethod.evaluate`, on the joint particles (:meth:`joint_particles`)
        in a model with client-local latents."""
        if self._layout is None:
            return super().evaluate(state, *args, **kwargs)
        self._setup(args, kwargs)
        x = self.joint_particles(state)
        score = self._target_score()
        return jnp.asarray(self.through_clients(lambda: kernel_stein_discrepancy(x, score(x))))

    def _finish_local(self, result):
        """With client-local latents: Stein's check of the global particles with the score of
        the global latents' marginal posterior (each client's ``"marginal_score"``,
        :func:`~numpyro_fed.infer.stein.local.marginal_scores`), Stein's moment correction of
        them with the same scores once every client has been scheduled, the runaway warning as
        :meth:`finish`'s."""
        prior_grad = jax.vmap(local_core.global_prior_grad(self.gradients.prior_grad, self._layout))

        def prior_score(theta):
            return -prior_grad(theta)

        def check(theta):  # Stein's statistics at theta and the least effective size of the importance draws
            score, ess = self._marginal_score(prior_score, result.state)
            mean, scale = self.through_clients(lambda: stein_moments(theta, score(theta)), result.ledger)
            return mean, scale, ess[0]

        all_visited = self._all_visited(result.metrics)

        def problems_of(result, mean, scale):
            return runaway_problems(
                self._initial_particles,
                result.metrics["particles"][-1],
                mean,
                scale,
                from_prior=self._from_prior,
                all_visited=all_visited,
            )

        mean, scale, ess = check(result.state.global_particles)
        problems = problems_of(result, mean, scale)
        corrected = self.moment_correction and all_visited and can_correct(*result.state.global_particles.shape)
        advice = None
        if corrected:
            score, _ = self._marginal_score(prior_score, result.state)
            before = problems
            result, kept, settled = self._correct_moments(result, problems, score)
            mean, scale, ess = check(result.state.global_particles)
            after = problems_of(result, mean, scale)
            problems = kept + [p for p in after if p not in kept]
            if not settled or after:  # the correction did not reach the target: restart it

                def passes(x):  # Stein's check with the marginal scores, and their importance draws
                    mean, scale, size = check(x)
                    bad = runaway_problems(
                        self._initial_particles, x, mean, scale, from_prior=self._from_prior, all_visited=True
                    )
                    return None if bad or size < MIN_CONDITIONAL_ESS else (mean, scale, size)

                failed = (
                    f"{'; '.join(before or problems)}, and Stein's moment correction of their particles did not "
                    "bring them to the target"
                )
                restarted = self._restart(result, failed, score, self._restart_starts(result), passes)
                if restarted is not None:
                    result, problems, (mean, scale, ess) = restarted
        result.metrics["conditional_ess"] = np.full(len(result.metrics["client"]), np.nan)
        result.metrics["conditional_ess"][-1] = ess
        if ess < MIN_CONDITIONAL_ESS:
            problems.append(
                f"a client's importance draws of its latents given the global particles had an effective size of "
                f"{ess:.2%} of their number (their conditional is far from its Laplace approximation), so the "
                "marginal scores of Stein's check and moment correction, and the draws of the latents, are noisy"
            )
        if problems:  # the remedy of a centred hierarchy, whose runs end here or non-finite
            problems.append(self.divergence_advice.replace("; otherwise lower learning_rate", ""))
        elif all_visited and not corrected:  # the rounds' particles are the answer here
            problems = unsettled_rounds(result.metrics["particles"], self.federated_potential.num_clients)
            advice = (
                "use more num_particles (the global latents' KDEs resolve a skewed posterior better), or FedZigZag, "
                "which samples it exactly"
            )
        warn_runaway(
            type(self).__name__,
            len(result.metrics["client"]),
            problems,
            fixed_kde=self.kde_bandwidth != "auto",
            stacklevel=5,
            advice=advice,
        )
        return result

    def _marginal_score(self, prior_score, state):
        """``(score, ess)``: ``score(theta) -> (N, d_g)``, the global latents' marginal
        posterior's score at the global particles ``theta`` from the prior's and every
        client's ``"marginal_score"`` (one call per client, in the ledger the caller's
        ``through_clients`` adds to), and ``ess``, a list that gets the least effective size
        of the clients' importance draws at each call."""
        call, ess = self._client_call("marginal_score"), []

        def score(theta):
            g, sizes = call(theta, state.clients)
            ess.append(float(np.min(np.asarray(sizes))))
            return prior_score(theta) - jnp.asarray(np.asarray(g).sum(axis=0), theta.dtype)

        return score, ess

    def _core_options(self) -> dict:
        return dict(
            num_local_steps=self.num_local_steps,
            num_distill_steps=self.num_distill_steps,
            optim=self.optim,
            distill_optim=self.distill_optim,
            kde_bandwidth=self.kde_bandwidth,
            svgd_bandwidth=self.svgd_bandwidth,
            temperature=self.temperature,
            stochastic_client_grad=self.stochastic_client_grad,
        )

    def client_functions(self):
        if self._layout is not None:
            options = self._core_options()
            del options["stochastic_client_grad"]
            potential = self.federated_potential.flat().client_potential
            return local_core.client_functions(*self.gradients, self._layout, client_potential=potential, **options)
        return dsvgd_core.client_functions(*self.gradients, **self._core_options())

    def build_round(self):
        min_clients = resolve_min_clients(self.min_clients, self.federated_potential.num_clients)
        return dsvgd_core.build_kernel(self.stochastic_client_grad is not None, min_clients)

    def _all_visited(self, metrics) -> bool:
        """Whether every client's update was applied in some round of the run."""
        return self._first_pass_end(metrics) is not None

    def _check_state(self, state):
        state = super()._check_state(state)
        num_clients = self.federated_potential.num_clients
        if np.shape(state.clients.version) != (num_clients,):
            raise ValueError(f"init_state has {np.shape(state.clients.version)[0]} clients, the model {num_clients}")
        return state._replace(clients=adopt_client_state(self._active_federation, state.clients))

    def finish(self, result):
        """Records the Stein statistics per round; warns if the last round's particles are
        absurd (see the class docstring)."""
        if self._layout is not None:
            return self._finish_local(result)
        divergence, self._divergence = self._divergence, None
        particles = result.metrics["particles"]
        if particles.shape[1] < 2:
            return result
        score = jax.jit(self._target_score())  # compiled once for the checks and the correction
        stein_mean, stein_scale = (np.array(v) for v in self._stein_metrics(particles, result.ledger, score))
        all_visited = self._all_visited(result.metrics)

        def problems_of(end, mean, scale, visited=all_visited):
            return runaway_problems(
                self._initial_particles, end, mean, scale, from_prior=self._from_prior, all_visited=visited
            )

        problems = problems_of(particles[-1], stein_mean[-1], stein_scale[-1])

        def passes(x):  # Stein's check of restarted particles, whichever clients the rounds reached
            mean, scale = self._stein_metrics(x[None], result.ledger, score)
            return None if problems_of(x, mean[0], scale[0], visited=True) else (mean[0], scale[0])

        if divergence is not None:  # the rounds diverged: the restart, or the error
            done, asked = divergence.state.rounds_done, divergence.state.num_rounds
            diverged = f"the rounds diverged (non-finite particles in round {done + 1} of {asked})"
            restarted = self._restart(result, diverged, score, self._restart_starts(result, diverged=True), passes)
            if restarted is None:
                raise divergence
            result, problems, (mean, scale) = restarted
            particles = result.metrics["particles"]
            stein_mean[-1], stein_scale[-1] = mean, scale
        elif self.moment_correction and all_visited and can_correct(*particles.shape[1:]):
            before = problems
            result, problems, settled = self._correct_moments(result, problems, score)
            particles = result.metrics["particles"]
            mean, scale = self._stein_metrics(particles[-1:], result.ledger, score)
            stein_mean, stein_scale = np.concatenate([stein_mean[:-1], mean]), np.concatenate([stein_scale[:-1], scale])
            after = problems_of(particles[-1], stein_mean[-1], stein_scale[-1])
            problems = problems + [p for p in after if p not in problems]
            if not settled or after:  # the correction did not reach the target: restart it
                failed = (
                    f"{'; '.join(before or problems)}, and Stein's moment correction of their particles did not "
                    "bring them to the target"
                )
                restarted = self._restart(result, failed, score, self._restart_starts(result), passes)
                if restarted is not None:
                    result, problems, (mean, scale) = restarted
                    particles = result.metrics["particles"]
                    stein_mean[-1], stein_scale[-1] = mean, scale
        result.metrics["stein_mean"], result.metrics["stein_scale"] = stein_mean, stein_scale
        warn_runaway(
            type(self).__name__,
            particles.shape[0],
            problems,
            fixed_kde=self.kde_bandwidth != "auto",
            stacklevel=4,
            advice=self._small_clients_advice(),
        )
        return result

    def _may_finish_diverged(self, error: FloatingPointError) -> bool:
        """With global latents and a start to restart Stein's moment correction from (the
        mode the run started at, or the particles at the end of the first pass over the
        clients, before the non-finite round), :meth:`finish` restarts it
        (:meth:`_restart`) and raises ``error`` only where that fails."""
        result = getattr(error, "result", None)
        return (
            self._layout is None
            and bool(self.moment_correction)
            and result is not None
            and "particles" in result.metrics
            and can_correct(*result.metrics["particles"].shape[1:])
            and (self._mode_laplace is not None or self._first_pass_end(result.metrics) is not None)
        )

    def _correction_steps(self, x, score, ledger):
        """Stein's moment correction from the particles ``x`` (at most ``moment_correction``
        steps, until one moves nothing: ``correction_settled``), each with the target's score at
        the particles from every client (``score``, through the clients, calls in ``ledger``), a
        step that fits Stein's identities worse (``stein_misfit``) halved up to
        :data:`MAX_HALVINGS` times: ``(particles, move, residuals)``, ``move`` the last step's
        (:func:`~numpyro_fed.infer.stein.moments.correction_move`; settled: below
        :data:`~numpyro_fed.infer.stein.moments.MOMENT_TOLERANCE`), ``nan`` where the score at
        ``x`` is not finite, ``inf`` where no step was taken."""
        g = self.through_clients(lambda: score(x), ledger)
        misfit, residuals = float(_misfit(x, g)), []
        if not np.isfinite(misfit):
            return x, math.nan, residuals
        move = math.inf
        for _ in range(self.moment_correction):
            target, residual = _moment_step(x, g)
            residuals.append(float(residual))
            # backtracking: a step whose particles fit Stein's identities worse than these is
            # halved (an affine map still), at most MAX_HALVINGS times; where the score is
            # nearly flat across the particles (a scale's tail) the fitted precision is small
            # and the full step overshoots (eight schools: log tau by 118, then overflow)
            for halving in range(MAX_HALVINGS + 1):
                moved = x + 0.5**halving * (target - x)
                g_moved = self.through_clients(lambda moved=moved: score(moved), ledger)
                moved_misfit = float(_misfit(moved, g_moved))
                # (with a slack of round-off's order: near the fixed point both are ~0, and a
                # comparison that round-off decides would halve on one engine and not another)
                if np.isfinite(moved_misfit) and moved_misfit <= max(misfit * (1.0 + 1e-6), 1e-10):
                    break
            else:  # no step along it fits better
                break
            move = correction_move(x, moved)
            x, g, misfit = moved, g_moved, moved_misfit
            if move < MOMENT_TOLERANCE:
                break
        return x, move, residuals

    @staticmethod
    def _with_last_particles(result, x, residual):
        """``result`` with ``x`` as the state's global particles and the last round's
        ``particles`` (``moment_residual``: the correction's last residual)."""
        particles = np.array(result.metrics["particles"])
        particles[-1] = np.asarray(x)
        result.metrics["particles"] = particles
        result.metrics["moment_residual"] = np.full(particles.shape[0], np.nan)
        result.metrics["moment_residual"][-1] = residual
        state = result.state._replace(global_particles=jnp.asarray(x, result.state.global_particles.dtype))
        return result._replace(state=state)

    def _correct_moments(self, result, problems, score):
        """Stein's moment correction of the last round's particles
        (:func:`~numpyro_fed.infer.stein.moments.stein_moment_correction`, :meth:`_correction_steps`),
        each step with every client's full-batch gradient at the particles (a
        ``"potential_grad"`` call, or with client-local latents a ``"marginal_score"``, in the
        ledger): the corrected particles become the state's global particles and the last
        round's ``particles``; where the correction does not settle the result is returned
        unchanged, with that among the problems. ``problems``: Stein's check of the
        uncorrected particles; returned only where the target is not close to Gaussian over
        the particles (the correction then rests on their shape), as a problem of the run.
        ``score``: the jitted :meth:`_target_score` (the Stein checks' too). Returns
        ``(result, problems, settled)``."""
        x, move, residuals = self._correction_steps(jnp.asarray(result.metrics["particles"][-1]), score, result.ledger)
        if np.isnan(move):  # a non-finite score: keep the particles
            return result, problems + ["Stein's moment correction met a non-finite score at the particles"], False
        if not move < MOMENT_TOLERANCE:  # the rounds' particles are returned
            return (
                result,
                problems
                + [
                    f"Stein's moment correction did not settle in {len(residuals)} step(s) (the target is not "
                    "close to Gaussian where the particles are), so the particles are the rounds'"
                ],
                False,
            )
        result = self._with_last_particles(result, x, residuals[-1])
        kept = []
        if problems and residuals[-1] > GAUSSIAN_RESIDUAL:
            kept = [
                f"before Stein's moment correction {'; '.join(problems)}, and the target is not close to "
                f"Gaussian over the particles (a linear score leaves {residuals[-1]:.3g} of its variance, "
                f"more than {GAUSSIAN_RESIDUAL}), so the correction cannot be trusted to fix it"
            ]
        return result, kept, True

    def _first_pass_end(self, metrics) -> int | None:
        """The first round (0-based) by the end of which every client had been scheduled (had
        its update applied, where clients may drop out); ``None`` if none."""
        if "participated" in metrics:  # (rounds, clients)
            applied = np.asarray(metrics["participated"], bool)
        else:  # the clients scheduled in each round, one or several
            clients = np.asarray(metrics["client"]).reshape(len(metrics["client"]), -1)
            applied = np.zeros((clients.shape[0], self.federated_potential.num_clients), bool)
            applied[np.arange(clients.shape[0])[:, None], clients] = True
        ends = np.flatnonzero(np.all(np.cumsum(applied, axis=0) > 0, axis=1))
        return int(ends[0]) if ends.size else None

    def _restart_starts(self, result, diverged: bool = False) -> list:
        """Where :meth:`_restart` starts Stein's moment correction again, in order, as
        ``(what, particles)``: the Laplace approximation at the posterior's mode the run
        started from (global latents; the initial particles whitened with their own
        covariance and mapped onto ``N(mode, H^{-1})``, so that nothing new is drawn and every
        engine restarts alike), then the particles at the end of the first pass over the
        clients (if the rounds went on past it, or ``diverged`` before going further)."""
        metrics, starts, laplace = result.metrics, [], self._mode_laplace
        if laplace is not None and self._layout is None:
            start = jnp.asarray(self._initial_particles)
            z = whitening(start, full=True).to_z(start)
            x = laplace.point + jax.scipy.linalg.solve_triangular(laplace.hessian_chol.T, z.T, lower=False).T
            if bool(jnp.all(jnp.isfinite(x))):
                starts.append(("the Laplace approximation at the posterior's mode the run started from", x))
        end = self._first_pass_end(metrics)
        last = len(metrics["particles"]) - 1
        if end is not None and (end < last or (diverged and end == last)):
            starts.append(
                (
                    f"the particles of round {end + 1}, the end of the first pass over the clients",
                    jnp.asarray(metrics["particles"][end]),
                )
            )
        return starts

    def _restart(self, result, failed: str, score, starts, passes):
        """Where the rounds ran away or diverged and Stein's moment correction of their
        particles did not bring them to the target (``failed`` says how): the same correction
        from each of ``starts`` in turn (:meth:`_restart_starts`), the first whose last step
        moved the particles less than :data:`RESTART_TOLERANCE` and whose particles pass
        Stein's check (``passes(particles)``: the check's statistics, or ``None``) adopted:
        ``(result, problems, statistics)``, the problems saying that the particles are not the
        rounds', where the correction started and, where the target is not close to Gaussian
        over them (:data:`~numpyro_fed.infer.stein.moments.GAUSSIAN_RESIDUAL`), that their
        shape is the start's; ``None`` where none is.

        Measured (1 December 2026, the real tier's cells at the zoo's key, 20 particles): on
        mtcars' 10 raw correlated covariates over 4 clients of 8 rows (12 coordinates) the
        rounds ran away (the correction of their particles settled 84 posterior sds off in
        ``beta[2]``); from the mode its particles agreed with NUTS within 0.04 sds on every
        mean, sds 0.84-1.06 of NUTS's (float64 and float32). On radon over 4 clients in
        float32 (client-local intercepts, no mode search) the rounds ran away from round 6 on
        and the correction of round 10's particles settled 141 sds off in ``mu_a``; from
        round 4's, the end of the first pass, within 0.01 sds, sds 0.99-1.07."""
        for origin, x in starts:
            x = jnp.asarray(x, result.state.global_particles.dtype)
            x, move, residuals = self._correction_steps(x, score, result.ledger)
            if not move < RESTART_TOLERANCE:
                continue
            statistics = passes(x)
            if statistics is None:
                continue
            result = self._with_last_particles(result, x, residuals[-1])
            shape = (
                f"; the target is not close to Gaussian over them (a linear score leaves {residuals[-1]:.3g} of its "
                f"variance, more than {GAUSSIAN_RESIDUAL}), so their shape is the start's, moved and scaled"
                if residuals[-1] > GAUSSIAN_RESIDUAL
                else ""
            )
            return (
                result,
                [
                    f"{failed}. The particles returned are not the rounds': Stein's moment correction started "
                    f"again from {origin} ({len(residuals)} step(s), the last moving a mean or an sd by {move:.2g} "
                    f"sds or less), and they pass Stein's check (the rounds' last particles are lost){shape}"
                ],
                statistics,
            )
        return None


class PDSVGD(DSVGD):
    """Parallel DSVGD (Appendix A.5, Algorithm 5): several clients per round.

    The scheduled clients run DSVGD's two loops from the server's particles in parallel, keep
    and upload their *local* particles (the state is a
    :class:`~numpyro_fed.infer.stein.pdsvgd.PDSVGDState`); the server distills ``q^(i) = p_0 prod_k t_k^(i)`` into its
    ``N`` particles with ``num_server_steps`` SVGD steps.

    :param clients_per_round: number of clients per round (an int ``>= 1``) or a fraction of
        them in ``(0, 1]`` (the paper's ``C``; rounded up).
    :param int num_server_steps: ``L_s`` (default: ``num_local_steps``).
    :param server_optim: optax step rule of the server's steps (default: ``optim``).
    :param client_order: ``"random"`` (default: a fresh random subset of distinct clients per
        round), ``"round_robin"`` or an ``(I, C)`` array of client indices.

    Other parameters as :class:`DSVGD`, ``federation`` and deployment (``loader=``) too.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=4):
    ...         numpyro.sample("y", dist.Normal(mu, 3), obs=y)
    >>> pdsvgd = nf.PDSVGD(model, clients_per_round=2, num_local_steps=50, num_distill_steps=50,
    ...                    progress_bar=False)
    >>> result = pdsvgd.run(jax.random.PRNGKey(0), 2, jnp.arange(4.0))
    >>> result.metrics["client"].shape
    (2, 2)
    """

    def __init__(
        self,
        model,
        *,
        clients_per_round=1,
        num_server_steps: int | None = None,
        server_optim=None,
        client_order="random",
        **kwargs,
    ):
        super().__init__(model, client_order=client_order, **kwargs)
        if isinstance(clients_per_round, bool) or not isinstance(
            clients_per_round, (int, float, np.integer, np.floating)
        ):
            raise TypeError(f"clients_per_round must be an int or a fraction, got {clients_per_round!r}")
        if isinstance(clients_per_round, (float, np.floating)) and not float(clients_per_round).is_integer():
            if not 0.0 < clients_per_round <= 1.0:
                raise ValueError(f"clients_per_round as a fraction must be in (0, 1], got {clients_per_round}")
        elif clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1 (or a fraction in (0, 1]), got {clients_per_round}")
        self.clients_per_round = clients_per_round
        self.num_server_steps = (
            self.num_local_steps
            if num_server_steps is None
            else check_int(num_server_steps, "num_server_steps", minimum=1)
        )
        self.server_optim = self.optim if server_optim is None else check_optim(server_optim, "server_optim")

    repr_fields = DSVGD.repr_fields + ("clients_per_round", "num_server_steps")
    local_latents = False
    local_latents_advice = "DSVGD runs models with client-local latents (each client's joint particles)"

    def _configure(self, fp):
        c = self.clients_per_round
        if isinstance(c, (float, np.floating)) and not float(c).is_integer():
            count = math.ceil(c * fp.num_clients)
        else:
            count = int(c)
        if count > fp.num_clients:
            raise ValueError(f"clients_per_round={count} exceeds the number of clients {fp.num_clients}")
        self._per_round = count

    def client_functions(self):
        return pdsvgd_core.client_functions(*self.gradients, **self._core_options())

    def build_round(self):
        server = pdsvgd_core.build_server(
            self.gradients.prior_grad,
            num_server_steps=self.num_server_steps,
            server_optim=self.server_optim,
            kde_bandwidth=self.kde_bandwidth,
            svgd_bandwidth=self.svgd_bandwidth,
        )
        return pdsvgd_core.build_kernel(server, self.stochastic_client_grad is not None)

    def initial_state(self, particles, num_rounds=None):
        return pdsvgd_core.init(particles, self._active_federation)


class UDSVGD(DSVGD):
    """U-DSVGD (Section 5.1, Algorithm 4): DSVGD without distillation.

    Each client remembers the global iterates before and after each round it was scheduled
    in (its client state, kept where it lives), and computes ``grad log t_k`` by the
    recursion (15) over them, so its memory grows with the rounds. Each round the server
    sends the scheduled client the global particles and the round's index; the client
    returns the new global particles. Parameters as :class:`DSVGD` (``num_distill_steps`` is ignored;
    ``federation`` and deployment, ``loader=``, as there). The
    buffers are sized by the number of rounds: :meth:`init` needs ``num_rounds`` and
    :meth:`run` takes no ``init_state``.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 3), obs=y)
    >>> udsvgd = nf.UDSVGD(model, num_local_steps=50, progress_bar=False)
    >>> udsvgd.run(jax.random.PRNGKey(0), 3, jnp.arange(4.0)).state.clients.values.history.shape
    (2, 4, 20, 1)
    """

    # its clients' buffers hold the global iterates, the recursion (15) of a continued run too:
    # the default leaves the last iterate as the rounds made it
    corrects_moments = False

    repr_fields = ("num_particles", "num_local_steps", "kde_bandwidth", "temperature", "client_order", "batch_size")
    local_latents = False
    local_latents_advice = "DSVGD runs models with client-local latents (each client's joint particles)"

    def _udsvgd_options(self):
        options = self._core_options()
        del options["num_distill_steps"], options["distill_optim"]
        return options

    def client_functions(self):
        return udsvgd_core.client_functions(*self.gradients, **self._udsvgd_options())

    def build_round(self):
        return udsvgd_core.build_kernel(self.stochastic_client_grad is not None)

    def _check_state(self, state):
        self._num_rounds = int(state.scheduled.shape[0])
        return ParticleMethod._check_state(self, state)

    def initial_state(self, particles, num_rounds=None):
        if num_rounds is None:
            raise ValueError("UDSVGD.init needs num_rounds: its clients' buffers are sized by it")
        self._num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        return udsvgd_core.init(particles, self._num_rounds, self._active_federation)

    def run(self, rng_key, num_rounds: int, *args, init_particles=None, **kwargs):
        """As :meth:`DSVGD.run` (no ``init_state``: the buffers are sized by ``num_rounds``)."""
        return super().run(rng_key, num_rounds, *args, init_particles=init_particles, **kwargs)
