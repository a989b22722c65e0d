"""The shared face of the SVGD family: model -> split potential -> rounds -> results.

Every method here mirrors :class:`numpyro.infer.SVI`: ``init``, ``update`` (one round),
``run``, ``get_samples``, ``evaluate``. A subclass says how to start (:meth:`_initial_state`),
how to run one round from the core (:meth:`build_step`) and where the particles are in its
state (:meth:`particles`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer.initialization import init_to_uniform

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.infer.stein.checks import stein_statistics
from numpyro_fed.infer.stein.client_order import make_client_order
from numpyro_fed.infer.stein.dsvgd import batched_client_grad
from numpyro_fed.infer.stein.kde import AUTO_KDE_FACTOR, shrunk_kde
from numpyro_fed.infer.stein.kernels import median_bandwidth, squared_distances
from numpyro_fed.infer.stein.model import client_block, flat_gradients, minibatch_client_grad, prior_draws
from numpyro_fed.potential import split_potential

__all__ = ["ParticleMethod", "ParticleRunResult", "kernel_stein_discrepancy"]


class ParticleRunResult(NamedTuple):
    """What ``run`` of the methods here returns.

    :ivar particles: ``(N, d)`` final particles, flat and unconstrained (see ``get_samples``
        for constrained values by site).
    :ivar state: the final state of the method.
    :ivar dict metrics: per-round metrics, each an array with a leading axis of
        ``num_rounds``: ``client`` (the scheduled client(s)), ``wall_time`` (seconds since
        the start, after each round), ``move`` where the core reports it, and the user's metrics.
    :ivar history: ``(num_rounds + 1, N, d)`` particles before the first round and after each.
    :ivar method: the method object that made the result (for
        :func:`~numpyro_fed.to_inference_data`).
    """

    particles: jax.Array
    state: Any
    metrics: dict
    history: jax.Array
    method: Any = None


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


class ParticleMethod:
    """Shared face of the methods here (not used directly).

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate` and global
        latent variables only.
    :param int num_particles: ``N``.
    :param dict metrics: ``{name: fn}`` evaluated on the particles after every round;
        ``fn(draws)`` receives a dict of constrained values by site (leading axis ``N``) and
        returns a number, an array or a dict of them (see
        :func:`numpyro_fed.metrics.kl_metric_1d`, :func:`numpyro_fed.metrics.classification_metrics`,
        :func:`numpyro_fed.metrics.regression_metrics`).
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: as for :func:`~numpyro_fed.split_potential` (the particles
        themselves start as prior draws).
    :param bool progress_bar: a progress bar over rounds.
    :param float temperature: ``alpha`` of the free energy (1: Bayes' posterior).
    :param int batch_size: rows of a client's data per step (``None``: all).
    """

    _per_round: int | None = None  # clients per round (P-DSVGD), None: one
    _step_size_name = "learning_rate"  # what to lower when the particles diverge
    _from_prior = True  # whether the current run started from prior draws

    def __init__(self, model, *, num_particles: int, metrics: Mapping[str, Callable] | None,
                 partition, init_strategy=init_to_uniform, progress_bar: bool = True,
                 temperature: float = 1.0, batch_size: int | None = None):
        if not callable(model):
            raise TypeError(f"model must be a callable NumPyro model, got {type(model).__name__}")
        self.model = model
        self.num_particles = check_int(num_particles, "num_particles", minimum=1)
        self.batch_size = None if batch_size is None else check_int(batch_size, "batch_size", minimum=1)
        self.temperature = check_positive(temperature, "temperature")
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not callable(fn):
                raise TypeError(f"metric '{name}' must be a callable draws -> value")
        self.metrics = metrics
        self.partition = partition
        self.init_strategy = init_strategy
        self.progress_bar = bool(progress_bar)
        self.federated_potential = None
        self._setup_key = None

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._repr_fields().items())
        return f"{type(self).__name__}({getattr(self.model, '__name__', 'model')}, {shown})"

    def _repr_fields(self) -> dict:
        return {"num_particles": self.num_particles}

    # -- model plumbing ------------------------------------------------------------------
    def _setup(self, args, kwargs):
        key = (tuple(map(id, args)), tuple((k, id(v)) for k, v in sorted(kwargs.items())))
        if self.federated_potential is not None and key == self._setup_key:
            return self.federated_potential
        fp = split_potential(self.model, args, kwargs, partition=self.partition,
                             init_strategy=self.init_strategy)
        local = np.asarray(fp.coordinate_owner) >= 0
        if local.any():
            sites = [name for name, owner in fp.coordinate_owner_tree.items() if (np.asarray(owner) >= 0).any()]
            raise ValueError(
                f"{type(self).__name__} infers global latent variables only; site(s) {sites} are "
                "client-local (inside a federated plate)"
            )
        self.federated_potential = fp
        self.gradients = flat_gradients(fp)
        self.stochastic_client_grad = (None if self.batch_size is None
                                       else minibatch_client_grad(fp, self.batch_size))
        unravel = fp.unravel
        self._postprocess = jax.jit(jax.vmap(lambda x: fp.postprocess_fn(unravel(x))))
        self._setup_key = key
        self._step = None
        self._configure(fp)
        return fp

    def _configure(self, fp):
        """Checks that need the potential (e.g. the number of clients)."""

    def _prior_particles(self, rng_key, args, kwargs, num):
        return prior_draws(self.model, self.federated_potential, rng_key, args, kwargs, num)

    def _check_particles(self, particles, name):
        d = self.federated_potential.num_latent
        particles = jnp.asarray(particles)
        if particles.shape != (self.num_particles, d):
            raise ValueError(f"{name} must have shape (num_particles, d) = ({self.num_particles}, {d}), "
                             f"got {particles.shape}")
        return particles

    def _client_grad_fn(self) -> Callable:
        """``(x (N, d), block, key) -> (N, d)``: minibatch or full-batch ``grad L_k``."""
        return batched_client_grad(self.gradients.client_grad, self.stochastic_client_grad)

    def _target_score(self) -> Callable:
        """``(N, d) -> (N, d)``: the full-batch score of the tempered posterior (every client's
        data; for diagnostics of this in-process emulation only)."""
        fp = self.federated_potential
        prior_score = jax.vmap(lambda x: -self.gradients.prior_grad(x))
        client_grad = jax.vmap(self.gradients.client_grad, in_axes=(0, None))
        temperature = self.temperature

        def score(x):
            grads = jax.vmap(client_grad, in_axes=(None, 0))(x, fp.client_data)
            return prior_score(x) - jnp.sum(grads, axis=0) / temperature

        return score

    # -- what a subclass provides -----------------------------------------------------------
    def particles(self, state) -> jax.Array:
        """The ``(N, d)`` particles (flat, unconstrained) of a state."""
        raise NotImplementedError

    def _initial_state(self, rng_key, particles, num_rounds):
        raise NotImplementedError

    def build_step(self) -> Callable:
        """One round as the method runs it: ``step(rng_key, state, client, block) -> (state,
        info)``, built from the core with the method's settings (``rng_key``: ``None`` unless
        the round draws minibatches or noise). The extension point of a variant: a subclass
        that overrides it runs its own rounds under the same driver. Call it after
        :meth:`init` (it needs the model's potential; :attr:`gradients` and
        :attr:`stochastic_client_grad` are then set)."""
        raise NotImplementedError

    # -- public ------------------------------------------------------------------------------
    def init(self, rng_key, *args, init_particles=None, num_rounds: int | None = None, **kwargs):
        """The initial state: particles drawn from the prior (or ``init_particles``, ``(N, d)``
        flat unconstrained), the potential built from the model's arguments ``args``,
        ``kwargs`` (the clients' data)."""
        self._setup(args, kwargs)
        if init_particles is None:
            particles = self._prior_particles(rng_key, args, kwargs, self.num_particles)
        else:
            particles = self._check_particles(init_particles, "init_particles")
        return self._initial_state(rng_key, particles, num_rounds)

    def _round(self, rng_key, state, client):
        if self._step is None:
            self._step = jax.jit(self.build_step())
        fp = self.federated_potential
        client = jnp.asarray(client)
        return self._step(rng_key, state, client, client_block(fp, client))

    def _round_key(self, rng_key):
        """The key a round passes to the core: used for minibatches only (the cores are
        deterministic otherwise)."""
        return None if self.stochastic_client_grad is None else rng_key

    def update(self, rng_key, state, *args, client=None, **kwargs):
        """One round: ``(state, info)``.

        ``client``: the client(s) to schedule (default: the method's client order at the
        state's round; a random order draws them from ``rng_key``).
        """
        fp = self._setup(args, kwargs)
        k_order, k_round = jax.random.split(rng_key)
        if client is None:
            done = int(self._rounds_done(state))
            client = make_client_order(self._order(), done + 1, fp.num_clients, k_order, self._per_round)[done]
        return self._round(self._round_key(k_round), state, client)

    def _order(self):
        return getattr(self, "client_order", "round_robin")

    def _rounds_done(self, state) -> int:
        return int(getattr(state, "round", 0))

    def constrained(self, particles) -> dict:
        """Constrained values by site of ``(S, d)`` flat unconstrained particles."""
        return self._postprocess(jnp.asarray(particles))

    def evaluate(self, state, *args, **kwargs) -> jax.Array:
        """The squared kernel Stein discrepancy (:func:`kernel_stein_discrepancy`) of the
        state's particles for the target, with every client's full-batch score: what SVGD
        decreases (these methods define no loss)."""
        self._setup(args, kwargs)
        x = self.particles(state)
        return kernel_stein_discrepancy(x, self._target_score()(x))

    def get_samples(self, rng_key, result, num_samples: int | None = None, *, smooth: bool = False) -> dict:
        """Constrained posterior draws by site.

        :param rng_key: key for the draws.
        :param result: what :meth:`run` returned.
        :param num_samples: draws to return; ``None``: the particles themselves.
        :param bool smooth: draw from the KDE of the particles (each draw is a random particle
            plus Gaussian noise of the KDE bandwidth, on the unconstrained space) rather than
            from the particles themselves. With ``kde_bandwidth="auto"``, the moment-keeping
            KDE (:func:`~numpyro_fed.infer.stein.kde.shrunk_kde`) per coordinate.
        """
        particles = jnp.asarray(result.particles)
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

    def _evaluate_metrics(self, particles):
        if not self.metrics:
            return {}
        draws = {k: np.asarray(v) for k, v in self.constrained(particles).items()}
        out = {}
        for name, fn in self.metrics.items():
            value = fn(draws)
            if isinstance(value, Mapping):
                out.update({f"{name}.{k}" if len(self.metrics) > 1 else k: v for k, v in value.items()})
            else:
                out[name] = value
        return out

    def run(self, rng_key, num_rounds: int, *args, init_state=None, init_particles=None, **kwargs):
        """Runs ``num_rounds`` communication rounds and returns a :class:`ParticleRunResult`.

        :param rng_key: key for the initial particles, a random client order and minibatches.
        :param int num_rounds: ``I``.
        :param args: the model's positional arguments (the clients' data).
        :param init_state: a state to continue from (e.g. ``result.state``).
        :param init_particles: ``(N, d)`` flat unconstrained initial particles instead of
            prior draws.
        :param kwargs: the model's keyword arguments.
        """
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        k_init, k_order, round_keys = self._run_keys(rng_key, num_rounds)
        fp = self._setup(args, kwargs)
        if init_state is None:
            state = self.init(k_init, *args, init_particles=init_particles, num_rounds=num_rounds, **kwargs)
        else:
            state = self._check_state(init_state)
        self._from_prior = init_state is None and init_particles is None
        order = make_client_order(self._order(), num_rounds, fp.num_clients, k_order, self._per_round)
        result = self._loop(num_rounds, state, lambda s, i: self._round(self._round_key(round_keys[i]), s, order[i]),
                            order)
        return self._finish(result, order)

    def _run_keys(self, rng_key, num_rounds):
        """``(k_init, k_order, round_keys)`` of a run: the initial particles, a random client
        order, and one key per round (``(num_rounds, 2)``)."""
        k_init, k_order = jax.random.split(rng_key)
        return k_init, k_order, jax.random.split(jax.random.fold_in(k_order, 1), num_rounds)

    def _check_state(self, state):
        self._check_particles(self.particles(state), "init_state's particles")
        return state

    def _finish(self, result, order):
        return result

    def _stein_metrics(self, history):
        """``stein_mean``, ``stein_scale`` per round (see :func:`~numpyro_fed.infer.stein.checks.stein_statistics`)."""
        stein_mean, stein_scale = stein_statistics(self._target_score())(history[1:])
        return np.asarray(stein_mean), np.asarray(stein_scale)

    def _loop(self, num_rounds, state, step, order):
        from tqdm.auto import tqdm

        history = [self.particles(state)]
        records: dict[str, list] = {"client": [], "wall_time": []}
        start = time.perf_counter()
        bar = tqdm(range(num_rounds), desc=type(self).__name__, disable=not self.progress_bar)
        for i in bar:
            state, info = step(state, i)
            particles = self.particles(state)
            finite = bool(jnp.all(jnp.isfinite(particles)))  # also waits for the round
            records["wall_time"].append(time.perf_counter() - start)
            if not finite:
                bar.close()
                raise FloatingPointError(
                    f"{type(self).__name__} diverged: non-finite particles after round {i + 1} "
                    f"of {num_rounds}; lower {self._step_size_name}"
                )
            records["client"].append(np.asarray(order[i]) if order is not None else -1)
            for name, value in (info._asdict() if hasattr(info, "_asdict") else dict(info)).items():
                if name != "client":
                    records.setdefault(name, []).append(np.asarray(value))
            history.append(particles)
            values = self._evaluate_metrics(particles)
            for name, value in values.items():
                records.setdefault(name, []).append(value)
            if self.progress_bar and values:
                scalars = {k: float(v) for k, v in values.items() if np.ndim(v) == 0}
                bar.set_postfix({k: f"{v:.4g}" for k, v in list(scalars.items())[:3]})
        metrics = {name: np.asarray(values) for name, values in records.items()}
        return ParticleRunResult(self.particles(state), state, metrics, jnp.stack(history), self)
