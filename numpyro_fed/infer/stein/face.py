"""The shared face of the SVGD family over :class:`~numpyro_fed.infer.base.VariationalMethod`.

Every method here mirrors :class:`numpyro.infer.SVI`: ``init``, ``update`` (one round),
``run`` (the rounds, by :func:`~numpyro_fed.infer.rounds.run_rounds`), ``get_samples``,
``evaluate``. A subclass says how to start (:meth:`ParticleMethod.initial_state`), what its
clients run (:meth:`ParticleMethod.client_functions`), how the server runs one round through
them (:meth:`ParticleMethod.build_round`, the core's step) and where the particles are in its
state (:meth:`ParticleMethod.particles`). Every method runs one path: its core's step against
the federation seam, on :class:`~numpyro_fed.federation.InProcess` (compiled into one program)
by default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer.initialization import init_to_sample

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.infer.base import ClientSpec, RunResult, VariationalMethod, jit_round
from numpyro_fed.infer.rounds import RunCheckpoint
from numpyro_fed.infer.stein.checks import stein_statistics
from numpyro_fed.infer.stein.client_order import make_client_order
from numpyro_fed.infer.stein.kde import AUTO_KDE_FACTOR, shrunk_kde
from numpyro_fed.infer.stein.kernels import median_bandwidth, squared_distances
from numpyro_fed.infer.stein.model import (
    flat_gradients,
    initial_particles,
    minibatch_client_grad,
    named_init_strategy,
)

__all__ = ["ParticleMethod", "kernel_stein_discrepancy"]


def kernel_stein_discrepancy(particles, scores, bandwidth=None) -> jax.Array:
    """The squared kernel Stein discrepancy of ``particles`` for the target whose score at them
    is ``scores``: the U-statistic (pairs ``i != j``) of the Stein kernel of the RBF kernel
    ``exp(-|x - y|^2 / h)`` (``h``: the median heuristic by default). An unbiased estimate,
    about 0 (it may be slightly negative) for particles distributed as the target; SVGD's
    steps descend it.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.PRNGKey(0), (500, 1))
    >>> near, far = kernel_stein_discrepancy(x, -x), kernel_stein_discrepancy(x + 1.0, -(x + 1.0))
    >>> bool(near < 0.1 < far)  # Monte Carlo noise of 500 draws: about 0.03
    True
    """
    n, d = particles.shape
    h = median_bandwidth(particles) if bandwidth is None else bandwidth
    k = jnp.exp(-squared_distances(particles, particles) / h)
    diff = particles[:, None, :] - particles[None, :, :]  # x_i - x_j
    term_scores = (scores @ scores.T) * k
    # s(x_i)^T grad_{x_j} k + grad_{x_i} k^T s(x_j), grad_{x_j} k = (2/h)(x_i - x_j) k
    term_cross = (2.0 / h) * k * (jnp.einsum("id,ijd->ij", scores, diff) - jnp.einsum("jd,ijd->ij", scores, diff))
    term_trace = k * (2.0 * d / h - 4.0 * jnp.sum(diff * diff, axis=-1) / h**2)
    stein_kernel = (term_scores + term_cross + term_trace) * (1.0 - jnp.eye(n, dtype=particles.dtype))
    return jnp.sum(stein_kernel) / (n * max(n - 1, 1))


class ParticleMethod(VariationalMethod):
    """Shared face of the methods here (not used directly).

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate` and global
        latent variables only (unless the method says otherwise: :attr:`local_latents`).
    :param int num_particles: ``N``.
    :param dict metrics: ``{name: fn}`` evaluated on the particles after every round;
        ``fn(draws)`` receives a dict of constrained values by site (leading axis ``N``) and
        returns a number, an array or a dict of them (see
        :func:`numpyro_fed.metrics.kl_metric_1d`, :func:`numpyro_fed.metrics.classification_metrics`,
        :func:`numpyro_fed.metrics.regression_metrics`).
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: a NumPyro init strategy, run once per initial particle
        (:func:`~numpyro_fed.infer.stein.model.initial_particles`) and passed to
        :func:`~numpyro_fed.split_potential`; default ``init_to_sample``: prior draws, and
        NumPyro's uniform ``(-2, 2)`` on the unconstrained space where the prior cannot be
        sampled (flat ``ImproperUniform`` priors).
    :param bool progress_bar: a progress bar over rounds.
    :param float temperature: ``alpha`` of the free energy (1: Bayes' posterior).
    :param int batch_size: rows of a client's data per step (``None``: all).

    **Results.** ``run`` returns a :class:`~numpyro_fed.infer.RunResult`: ``state`` (the
    method's state; :meth:`particles` gives its ``(N, d)`` flat unconstrained particles) and
    ``metrics``, per round: ``client`` (the scheduled client(s); -1: all), ``move`` (root mean
    square move of the particles), ``particles`` (the particles after the round, ``(N, d)``),
    ``wall_time`` and the user's metrics. These methods define no loss: :meth:`evaluate`
    gives the kernel Stein discrepancy of a state's particles instead.
    """

    repr_fields = ("num_particles",)
    divergence_advice = "lower learning_rate"
    #: whether the method runs in deployment (``federation=`` with a ``loader``) and on
    #: engine backends; the baselines, references run in simulation, do not.
    deployable = True
    _per_round: int | None = None  # clients per round (P-DSVGD), None: one
    #: whether the method infers client-local latent variables (a model with some is refused
    #: by name otherwise, with :attr:`local_latents_advice`)
    local_latents = False
    local_latents_advice = ""
    _from_prior = True  # whether the current run started from prior draws
    _start_ledger: dict | None = None  # the calls _start_particles made (a run counts them)
    _start_search = None  # _start_particles' compiled program, once per split of the model
    _mode_laplace = None  # the Laplace approximation at the mode _start_particles moved the particles to
    _divergence = None  # the FloatingPointError of a run that finish() takes over (_may_finish_diverged)

    def __init__(
        self,
        model,
        *,
        num_particles: int,
        metrics: Mapping[str, Callable] | None,
        partition,
        init_strategy=init_to_sample,
        progress_bar: bool = True,
        temperature: float = 1.0,
        batch_size: int | None = None,
        federation=None,
    ):
        super().__init__(
            model,
            partition=partition,
            init_strategy=named_init_strategy(init_strategy),
            progress_bar=progress_bar,
            federation=federation,
        )
        self.num_particles = check_int(num_particles, "num_particles", minimum=1)
        self.batch_size = None if batch_size is None else check_int(batch_size, "batch_size", minimum=1)
        self.temperature = check_positive(temperature, "temperature")
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not callable(fn):
                raise TypeError(f"metric '{name}' must be a callable draws -> value")
        self.metrics = metrics
        self._setup_key = None
        self._step = None

    # -- model plumbing ------------------------------------------------------------------
    def _setup(self, args, kwargs):
        """Splits the model, builds what the core takes and starts the clients (once per set
        of arguments)."""
        key = (tuple(map(id, args)), tuple((k, id(v)) for k, v in sorted(kwargs.items())))
        if self.federated_potential is not None and key == self._setup_key:
            return self.federated_potential
        self._client_spec = self.plan_clients(None, args, kwargs)
        self._setup_key = key
        self.start_clients(**self._client_spec._asdict())
        return self.federated_potential

    def plan_clients(self, rng_key, args, kwargs, *, num_rounds=None) -> ClientSpec:
        """Splits the model and returns what the clients run: :meth:`client_functions` and
        ``"potential_grad"``, ``(block, x (K, d)) -> (K, d)``, the gradient of the client's
        term at each point (the diagnostics' full-batch score, :meth:`_target_score`; not one
        of the algorithm's messages). Each client's block is its own rows (built on its
        worker in deployment). The program depends on neither the key nor the rounds."""
        name = type(self).__name__
        if self.federation.deployed and not self.deployable:
            raise ValueError(
                f"{name} is a baseline, a reference run in this process; it cannot run in deployment "
                f"(federation={self.federation!r}: the rows stay on the clients). Run it in simulation on "
                f"the pooled data, {name}(model, ...).run(rng_key, num_rounds, *data), or use DSVGD, "
                "PDSVGD or UDSVGD, which run in deployment"
            )
        if not (self.federation.in_process or self.deployable):
            raise ValueError(
                f"{name} runs its clients in this process only: federation={self.federation!r} does not apply"
            )
        fp = self.build_potential(
            args, kwargs, global_latents_only=not self.local_latents, advice=self.local_latents_advice
        )
        self.gradients = flat_gradients(fp)
        self.stochastic_client_grad = None if self.batch_size is None else minibatch_client_grad(fp, self.batch_size)
        self._postprocess = jax.jit(jax.vmap(fp.flat().postprocess))
        self._step = self._start_search = None
        self._configure(fp)
        functions, stateful = self.client_functions()
        client_grad = jax.vmap(self.gradients.client_grad, in_axes=(0, None))
        functions = {"potential_grad": lambda block, x: client_grad(x, block), **self._setup_functions(fp), **functions}
        return ClientSpec(functions, stateful=stateful)

    def _setup_functions(self, fp) -> dict:
        """Further calls of the clients before the rounds (:class:`DSVGD`'s mode search); none
        here."""
        return {}

    def _configure(self, fp):
        """Checks that need the potential (e.g. the number of clients)."""

    def _state_dim(self) -> int:
        """The dimension of the particles a state holds (:meth:`particles`)."""
        return self.federated_potential.num_latent

    def _check_particles(self, particles, name, d=None):
        d = self.federated_potential.num_latent if d is None else d
        particles = jnp.asarray(particles)
        if particles.shape != (self.num_particles, d):
            raise ValueError(
                f"{name} must have shape (num_particles, d) = ({self.num_particles}, {d}), got {particles.shape}"
            )
        return particles

    def _target_score(self, federation=None) -> Callable:
        """``(N, d) -> (N, d)``: the full-batch score of the tempered posterior, for
        diagnostics: each client computes its term's gradient at the points
        (``"potential_grad"``: the points down, ``(N, d)`` up; run it inside
        :meth:`through_clients`). ``federation``: the started one to ask (default the active
        one)."""
        prior_score = jax.vmap(lambda x: -self.gradients.prior_grad(x))
        temperature = self.temperature
        federation = self._active_federation if federation is None else federation

        def score(x):
            return prior_score(x) - jnp.sum(federation.map("potential_grad", x), axis=0) / temperature

        return score

    # -- what a subclass provides -----------------------------------------------------------
    def particles(self, state) -> jax.Array:
        """The ``(N, d)`` particles (flat, unconstrained) of a state."""
        raise NotImplementedError

    def initial_state(self, particles, num_rounds: int | None):
        """The state of a run from ``particles`` (``(N, d)``; ``num_rounds``: only for methods
        whose buffers it sizes)."""
        raise NotImplementedError

    def client_functions(self) -> tuple[dict, dict]:
        """What the clients run, ``(functions, stateful)`` as a
        :class:`~numpyro_fed.federation.ClientProgram` takes them: functions of the client's
        block, ``f(block, *args) -> reply``, and functions of its own state too, ``f(block,
        state, *args) -> (state, reply)``; started on :attr:`federation` when the model is
        split (:attr:`gradients` and :attr:`stochastic_client_grad` are then set)."""
        raise NotImplementedError

    def build_round(self) -> Callable:
        """One round, the core's step: ``step(rng_key, state, federation, client) -> (state,
        info)`` (the server's side; the clients are reached through ``federation``;
        ``rng_key``: see :meth:`_round_key`). The extension point of a variant: a subclass
        that overrides it (and :meth:`client_functions`) runs its own rounds under the same
        driver, on every backend."""
        raise NotImplementedError

    # -- SVI's face ------------------------------------------------------------------------------
    def init(self, rng_key, *args, init_particles=None, num_rounds: int | None = None, **kwargs):
        """The initial state: particles from the init strategy (or ``init_particles``, ``(N, d)``
        flat unconstrained), the potential split on the model's arguments ``args``,
        ``kwargs`` (the clients' data)."""
        self._setup(args, kwargs)
        self._mode_laplace = None
        if init_particles is None:
            particles = initial_particles(
                self.model, self.federated_potential, rng_key, args, kwargs, self.num_particles, self.init_strategy
            )
            particles = self._start_particles(particles)
        else:
            particles = self._check_particles(init_particles, "init_particles")
        return self.initial_state(particles, num_rounds)

    def _start_particles(self, particles):
        """The initial particles of a run from the init strategy's draws (``(N, d)``), where
        the method moves them before its first round (DSVGD's start at the posterior's mode;
        the calls of the clients it makes go to ``_start_ledger``); as drawn here."""
        return particles

    def init_key(self, rng_key):
        return self._run_keys(rng_key)[0]

    def _round(self, rng_key, state, client):
        federation = self._active_federation
        if self._step is None:
            step = self.build_round()
            # the federation last: jit_round passes an InProcess as an argument (its blocks are
            # not baked into the program) and closes over any other
            self._step = jit_round(lambda key, s, c, fed: step(key, s, fed, c))
        with federation.guard():
            return self._step(rng_key, state, jnp.asarray(client), federation)

    def _round_key(self, rng_key):
        """The key a round passes to the core: used for minibatches only (the cores are
        deterministic otherwise)."""
        return None if self.stochastic_client_grad is None else rng_key

    def _order(self):
        return getattr(self, "client_order", "round_robin")

    def _rounds_done(self, state) -> int:
        return int(state.round)

    def update(self, rng_key, state, *args, client=None, **kwargs):
        """One round: ``(state, info)``.

        ``client``: the client(s) to schedule (default: the method's client order at the
        state's round; a random order draws them from ``rng_key``).
        """
        fp = self._setup(args, kwargs)
        k_order, k_round = jax.random.split(rng_key)
        if client is None:
            done = self._rounds_done(state)
            client = make_client_order(self._order(), done + 1, fp.num_clients, k_order, self._per_round)[done]
        return self._round(self._round_key(k_round), state, client)

    def constrained(self, particles) -> dict:
        """Constrained values by site of ``(S, d)`` flat unconstrained particles."""
        return self._postprocess(jnp.asarray(particles))

    def evaluate(self, state, *args, **kwargs) -> jax.Array:
        """The squared kernel Stein discrepancy (:func:`kernel_stein_discrepancy`) of the
        state's particles for the target, with every client's full-batch score: what SVGD
        decreases (these methods define no loss)."""
        self._setup(args, kwargs)
        x = self.particles(state)
        score = self._target_score()
        return jnp.asarray(self.through_clients(lambda: kernel_stein_discrepancy(x, score(x))))

    def get_samples(self, rng_key, result: RunResult, num_samples: int | None = None, *, smooth: bool = False) -> dict:
        """Constrained posterior draws by site.

        :param rng_key: key for the draws (unused with ``num_samples=None``).
        :param result: what :meth:`run` returned.
        :param num_samples: draws to return; ``None``: the particles themselves.
        :param bool smooth: draw from the KDE of the particles (each draw is a random particle
            plus Gaussian noise of the KDE bandwidth, on the unconstrained space) rather than
            from the particles themselves. With ``kde_bandwidth="auto"``, the moment-keeping
            KDE (:func:`~numpyro_fed.infer.stein.kde.shrunk_kde`) per coordinate.
        """
        particles = jnp.asarray(self.particles(result.state))
        if num_samples is None:
            if smooth:
                raise ValueError("smooth=True needs num_samples")
            return self.constrained(particles)
        num_samples = check_int(num_samples, "num_samples", minimum=1)
        k_pick, k_noise = jax.random.split(rng_key)
        index = jax.random.randint(k_pick, (num_samples,), 0, particles.shape[0])
        draws = particles[index]
        if smooth:
            bandwidth = getattr(self, "kde_bandwidth", None)
            if bandwidth is None:
                raise ValueError(f"{type(self).__name__} has no KDE: smooth=True does not apply")
            if bandwidth == "auto":
                shrunk, bandwidth = shrunk_kde(particles, AUTO_KDE_FACTOR)
                draws = shrunk[index]
            draws = draws + bandwidth * jax.random.normal(k_noise, draws.shape, draws.dtype)
        return self.constrained(draws)

    # -- the driver's extension points -------------------------------------------------------------
    def record(self, state, info) -> dict:
        """A round's metrics: the core's info (``client``, ``move``), the particles and the
        user's metrics of them."""
        out = super().record(state, info)
        particles = self.particles(state)
        out["particles"] = particles
        if self.metrics:
            draws = {k: np.asarray(v) for k, v in self.constrained(particles).items()}
            for name, fn in self.metrics.items():
                value = fn(draws)
                if isinstance(value, Mapping):
                    out.update({f"{name}.{k}" if len(self.metrics) > 1 else k: v for k, v in value.items()})
                else:
                    out[name] = value
        return out

    def arviz_dicts(self, result: RunResult, **options) -> dict:
        """As :meth:`VariationalMethod.arviz_dicts`, without the per-round ``particles`` (the
        trajectory, not a diagnostic)."""
        dicts = super().arviz_dicts(result, **options)
        dicts["sample_stats"].pop("particles", None)
        return dicts

    def _stein_metrics(self, particles, ledger: dict | None = None, score: Callable | None = None):
        """``stein_mean``, ``stein_scale`` per round (see
        :func:`~numpyro_fed.infer.stein.checks.stein_statistics`) of ``(R, N, d)`` particles
        (on a federation: one ``"potential_grad"`` call per round's particles, added to
        ``ledger``). ``score``: the jitted :meth:`_target_score` to use (a run's finish
        passes one, compiled once for all its checks)."""
        particles = jnp.asarray(particles)
        statistics = stein_statistics(jax.jit(self._target_score()) if score is None else score)
        return self.through_clients(lambda: statistics(particles), ledger)

    def _run_keys(self, rng_key):
        """``(k_init, k_order, k_rounds)`` of a run: the initial particles, a random client
        order, and the key the driver splits into one key per round."""
        k_init, k_order = jax.random.split(rng_key)
        return k_init, k_order, jax.random.fold_in(k_order, 1)

    def _check_state(self, state):
        self._check_particles(self.particles(state), "init_state's particles", self._state_dim())
        return state

    def run(self, rng_key, num_rounds: int, *args, init_state=None, init_particles=None, **kwargs) -> RunResult:
        """Runs ``num_rounds`` communication rounds.

        :param rng_key: key for the initial particles, a random client order and minibatches.
        :param int num_rounds: ``I``.
        :param args: the model's positional arguments (the clients' data).
        :param init_state: a state to continue from (e.g. ``result.state``), or the
            :class:`~numpyro_fed.infer.rounds.RunCheckpoint` of a run stopped by a
            :class:`~numpyro_fed.federation.ClientError` (``error.state``) to resume it: with
            the run's ``rng_key`` and ``num_rounds``, the result is the uninterrupted run's.
        :param init_particles: ``(N, d)`` flat unconstrained initial particles instead of
            prior draws.
        :param kwargs: the model's keyword arguments.
        """
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        k_init, k_order, k_rounds = self._run_keys(rng_key)
        fp = self._setup(args, kwargs)
        if init_state is None:
            state = self.init(k_init, *args, init_particles=init_particles, num_rounds=num_rounds, **kwargs)
        elif isinstance(init_state, RunCheckpoint):
            state = self._check_state(init_state.state)
            self.start_clients(**self._client_spec._asdict())  # the run stopped on a client's fault: fresh clients
        else:
            state = self._check_state(init_state)
        resume = init_state if isinstance(init_state, RunCheckpoint) else None
        if resume is not None:
            context = resume.context
            self._from_prior, self._initial_particles = context["from_prior"], context["initial_particles"]
            self._mode_laplace, start = context.get("mode_laplace"), context["start"]
        else:
            self._from_prior = init_state is None and init_particles is None
            if init_state is not None:  # no start of this run's
                self._mode_laplace = None
            self._initial_particles = self.particles(state)
            start = self._rounds_done(state)
        order = make_client_order(self._order(), num_rounds, fp.num_clients, k_order, self._per_round)

        def update(key, s):
            return self._round(self._round_key(key), s, order[self._rounds_done(s) - start])

        start_ledger, self._start_ledger = self._start_ledger, None
        self._divergence = None
        try:
            result = self.drive(
                update,
                k_rounds,
                state,
                num_rounds,
                resume=resume,
                is_finite=lambda s: bool(jnp.all(jnp.isfinite(self.particles(s)))),
                context={
                    "from_prior": self._from_prior,
                    "initial_particles": self._initial_particles,
                    "start": start,
                    "mode_laplace": self._mode_laplace,
                },
                ledger=start_ledger if init_state is None else None,
            )
        except FloatingPointError as error:
            if not self._may_finish_diverged(error):
                raise
            self._divergence, result = error, error.result
        return self.finish(result)

    def _may_finish_diverged(self, error: FloatingPointError) -> bool:
        """Whether :meth:`finish` may take the rounds completed before a run diverged
        (``error.result``; ``self._divergence`` is then ``error``) instead of the error being
        raised: never here (DSVGD restarts at the mode where it can)."""
        return False
