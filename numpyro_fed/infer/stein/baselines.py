"""The baselines of the DSVGD paper under DSVGD's interface: centralized :class:`SVGD` on the
pooled potential, :class:`FedAvg` (a point estimate) and :class:`DistributedSGLD`: thin faces
over the cores :mod:`~numpyro_fed.infer.stein.pooled_svgd`,
:mod:`~numpyro_fed.infer.stein.fedavg` and :mod:`~numpyro_fed.infer.stein.sgld`, which reach
the clients through the federation seam (references run in simulation, in this process)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from numpyro.infer.initialization import init_to_sample

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.infer.stein import fedavg as fedavg_core
from numpyro_fed.infer.stein import pooled_svgd as pooled_core
from numpyro_fed.infer.stein import sgld as sgld_core
from numpyro_fed.infer.stein.client_order import check_client_order
from numpyro_fed.infer.stein.face import ParticleMethod
from numpyro_fed.infer.stein.model import minibatch_client_grad
from numpyro_fed.infer.stein.optim import adagrad_momentum, check_optim

__all__ = ["DistributedSGLD", "FedAvg", "SVGD"]


class SVGD(ParticleMethod):
    """Centralized SVGD on the pooled potential (the paper's reference), as a round method.

    Runs ``num_rounds * steps_per_round`` SVGD steps towards ``p_0 exp(-(1/alpha) sum_k L_k)``
    with the same number of particles; a "round" is ``steps_per_round`` steps, so curves line
    up with DSVGD's ``I x L`` iterations. The optimizer's state is kept across rounds.

    :param int steps_per_round: SVGD steps per recorded round (e.g. DSVGD's ``num_local_steps``).
    :param float learning_rate: of the default optimizer (AdaGrad with momentum).
    :param optim: an optax ``GradientTransformation`` overriding ``learning_rate``.
    :param int batch_size: rows of the pooled data per step, ``ceil(batch_size / K)`` from each
        client (``None``: all).
    :param federation: ``None`` or an :class:`~numpyro_fed.InProcess` without a loader only:
        a baseline is a reference run in simulation, its clients reached through the seam in
        this process (it refuses another federation, and deployment, with a ``ValueError``);
        ``result.ledger`` counts its messages.

    Other parameters as :class:`~numpyro_fed.DSVGD`; ``metrics["client"]`` is -1 (every
    client's data in every step). No loss: :meth:`evaluate` gives the kernel Stein discrepancy.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 3), obs=y)
    >>> svgd = nf.SVGD(model, steps_per_round=100, progress_bar=False)
    >>> result = svgd.run(jax.random.PRNGKey(0), 3, jnp.array([0.5, 1.5, 2.0, 4.0]))
    >>> abs(float(svgd.particles(result.state).mean()) - 1.6) < 0.3
    True
    """

    repr_fields = ("num_particles", "steps_per_round", "temperature", "batch_size")
    deployable = False

    def __init__(
        self,
        model,
        *,
        num_particles: int = 20,
        steps_per_round: int = 200,
        learning_rate: float = 0.05,
        optim=None,
        svgd_bandwidth=None,
        temperature: float = 1.0,
        metrics=None,
        partition=None,
        init_strategy=init_to_sample,
        progress_bar: bool = True,
        batch_size: int | None = None,
        federation=None,
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
        self.steps_per_round = check_int(steps_per_round, "steps_per_round", minimum=1)
        self.learning_rate = check_positive(learning_rate, "learning_rate")
        self.optim = adagrad_momentum(self.learning_rate) if optim is None else check_optim(optim, "optim")
        self.svgd_bandwidth = None if svgd_bandwidth is None else check_positive(svgd_bandwidth, "svgd_bandwidth")

    def particles(self, state):
        return state.particles

    def _order(self):
        return "round_robin"

    def _run_keys(self, rng_key):
        return rng_key, None, jax.random.fold_in(rng_key, 1)

    def initial_state(self, particles, num_rounds=None):
        return pooled_core.init(particles, self.optim)

    def _round_key(self, rng_key):
        return rng_key

    def client_functions(self):
        fp = self.federated_potential
        stochastic = (
            None if self.batch_size is None else minibatch_client_grad(fp, math.ceil(self.batch_size / fp.num_clients))
        )
        return pooled_core.client_functions(self.gradients.client_grad, stochastic)

    def build_round(self):
        step = pooled_core.build_kernel(
            self.gradients.prior_grad,
            self.optim,
            num_steps=self.steps_per_round,
            temperature=self.temperature,
            bandwidth=self.svgd_bandwidth,
            stochastic=self.batch_size is not None,
        )
        return lambda rng_key, state, federation, client: step(rng_key, state, federation)


class FedAvg(ParticleMethod):
    """Federated averaging with one client per round, as in the paper's comparisons.

    A point estimate: the server holds one parameter vector; the scheduled client runs
    ``num_local_steps`` optimizer steps on its objective ``L_k(theta) + (1/K) (-log p_0(theta))``
    (its loss plus its share of the prior, so that the clients' objectives add up to the
    negative log posterior) and uploads the result. :meth:`get_samples` repeats the point.
    No loss is recorded: :meth:`evaluate` gives the kernel Stein discrepancy (of one point).

    :param int num_local_steps: ``L``.
    :param float learning_rate: of the default optimizer (AdaGrad with momentum).
    :param optim: an optax ``GradientTransformation`` overriding ``learning_rate``.
    :param client_order: as :class:`~numpyro_fed.DSVGD`.
    :param int batch_size: as :class:`~numpyro_fed.DSVGD`.
    :param federation: ``None`` or an :class:`~numpyro_fed.InProcess` without a loader only:
        a baseline is a reference run in simulation, its clients reached through the seam in
        this process (it refuses another federation, and deployment, with a ``ValueError``);
        ``result.ledger`` counts its messages.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 3), obs=y)
    >>> fedavg = nf.FedAvg(model, num_local_steps=50, progress_bar=False)
    >>> fedavg.run(jax.random.PRNGKey(0), 2, jnp.arange(4.0)).state.particles.shape
    (1, 1)
    """

    repr_fields = ("num_local_steps", "client_order", "batch_size")
    deployable = False

    def __init__(
        self,
        model,
        *,
        num_local_steps: int = 200,
        learning_rate: float = 0.05,
        optim=None,
        client_order="round_robin",
        metrics=None,
        partition=None,
        init_strategy=init_to_sample,
        progress_bar: bool = True,
        batch_size: int | None = None,
        federation=None,
    ):
        super().__init__(
            model,
            num_particles=1,
            metrics=metrics,
            partition=partition,
            init_strategy=init_strategy,
            progress_bar=progress_bar,
            temperature=1.0,
            batch_size=batch_size,
            federation=federation,
        )
        self.num_local_steps = check_int(num_local_steps, "num_local_steps", minimum=1)
        self.learning_rate = check_positive(learning_rate, "learning_rate")
        self.optim = adagrad_momentum(self.learning_rate) if optim is None else check_optim(optim, "optim")
        self.client_order = check_client_order(client_order)

    def particles(self, state):
        return state.particles

    def initial_state(self, particles, num_rounds=None):
        return fedavg_core.init(particles)

    def _round_key(self, rng_key):
        return rng_key

    def client_functions(self):
        return fedavg_core.client_functions(
            *self.gradients,
            num_clients=self.federated_potential.num_clients,
            num_local_steps=self.num_local_steps,
            optim=self.optim,
            stochastic_client_grad=self.stochastic_client_grad,
        )

    def build_round(self):
        return fedavg_core.build_kernel()

    def init(self, rng_key, *args, init_params=None, num_rounds=None, **kwargs):
        """The initial state: a prior draw, or ``init_params`` (``(d,)`` flat unconstrained)."""
        if init_params is not None:
            self._setup(args, kwargs)
            init_params = jnp.reshape(jnp.asarray(init_params), (1, -1))
            return self.initial_state(self._check_particles(init_params, "init_params"), num_rounds)
        return super().init(rng_key, *args, num_rounds=num_rounds, **kwargs)

    def run(self, rng_key, num_rounds: int, *args, init_state=None, init_params=None, **kwargs):
        """``init_params``: ``(d,)`` flat unconstrained start (default: a prior draw)."""
        if init_params is not None and init_state is None:
            self._setup(args, kwargs)
            init_state = self.init(jax.random.split(rng_key)[0], *args, init_params=init_params, **kwargs)
        return super().run(rng_key, num_rounds, *args, init_state=init_state, **kwargs)


class DistributedSGLD(ParticleMethod):
    """Distributed SGLD (Ahn et al. 2014) with one scheduled client per round.

    The server holds ``N`` chains; the scheduled client ``k`` moves every chain with
    ``num_local_steps`` Langevin steps on its data, the gradient of its loss scaled up to the
    whole data set: ``grad U ≈ grad(-log p_0) + (n / n_k) (1/alpha) grad L_k``. Step sizes
    follow the paper's annealing ``a0 (0.5 + t)^(-0.55)`` with ``t`` the global step count.
    No loss: :meth:`evaluate` gives the kernel Stein discrepancy of the chains' states.

    :param int num_particles: number of chains.
    :param int num_local_steps: Langevin steps per round.
    :param float a0: step-size scale (the paper's Table 4: 0.01, 0.0005 for large data; its
        authors' code also divides each step by the number of chains). The largest stable
        step shrinks with the data size: Langevin steps need ``eps`` below about
        ``2 / (largest curvature of U)``.
    :param client_order: as :class:`~numpyro_fed.DSVGD`.
    :param int batch_size: as :class:`~numpyro_fed.DSVGD`.
    :param federation: ``None`` or an :class:`~numpyro_fed.InProcess` without a loader only:
        a baseline is a reference run in simulation, its clients reached through the seam in
        this process (it refuses another federation, and deployment, with a ``ValueError``);
        ``result.ledger`` counts its messages.

    Non-finite chains stop the run with a :class:`FloatingPointError` naming ``a0``.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 3), obs=y)
    >>> sgld = nf.DistributedSGLD(model, num_local_steps=50, a0=0.5, progress_bar=False)
    >>> sgld.run(jax.random.PRNGKey(0), 2, jnp.arange(4.0)).state.particles.shape
    (20, 1)
    """

    repr_fields = ("num_particles", "num_local_steps", "a0", "client_order", "batch_size")
    deployable = False
    divergence_advice = "lower a0"

    def __init__(
        self,
        model,
        *,
        num_particles: int = 20,
        num_local_steps: int = 200,
        a0: float = 0.01,
        temperature: float = 1.0,
        client_order="round_robin",
        metrics=None,
        partition=None,
        init_strategy=init_to_sample,
        progress_bar: bool = True,
        batch_size: int | None = None,
        federation=None,
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
        self.a0 = check_positive(a0, "a0")
        self.client_order = check_client_order(client_order)

    def particles(self, state):
        return state.particles

    def initial_state(self, particles, num_rounds=None):
        return fedavg_core.init(particles)

    def _round_key(self, rng_key):
        return rng_key

    def _run_keys(self, rng_key):
        return tuple(jax.random.split(rng_key, 3))  # k_init, k_order, k_noise

    def client_functions(self):
        return sgld_core.client_functions(
            *self.gradients,
            num_local_steps=self.num_local_steps,
            a0=self.a0,
            stochastic_client_grad=self.stochastic_client_grad,
        )

    def build_round(self):
        return sgld_core.build_kernel(
            self.federated_potential.client_sizes, num_local_steps=self.num_local_steps, temperature=self.temperature
        )
