"""What the decentralised samplers share: agents' local potentials and the NumPyro face.

Every agent ``i`` (one per client) holds the local potential

    f_i(x) = client_potential_i(x) + w_i * prior_potential(x),   sum_i w_i = 1,

on the flat unconstrained latent vector ``x`` (``w_i = 1/N`` by default, as in Eq. (27) of
the D-ADMMS paper), so that ``sum_i f_i`` is NumPyro's potential energy. The algorithm cores
(:mod:`~numpyro_fed.infer.admm`, :mod:`~numpyro_fed.infer.baselines`) see only
:class:`AgentPotentials`; :class:`DecentralisedKernel` turns a core into a NumPyro
``MCMCKernel``: one MCMC sample per iteration is one agent's iterate (site shapes as in the
model, so ``MCMC.get_samples()`` goes straight into :class:`~numpyro.infer.Predictive`), and
every agent's iterate and the network average are recorded beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple
import warnings

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import is_prng_key

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.infer.topology import make_topology
from numpyro_fed.potential import split_potential

__all__ = ["AgentPotentials", "DecentralisedKernel", "DecentralisedState", "agent_potentials"]

class AgentPotentials(NamedTuple):
    """The agents' local potentials as one vmappable function.

    :ivar fn: ``(x, block, prior_weight) -> f_i(x)`` for a flat ``x`` of shape ``(d,)``,
        an agent's data block and its share of the prior.
    :ivar data: the stacked client blocks (leading axis ``N``).
    :ivar prior_weights: ``(N,)`` shares of the prior, summing to one.
    :ivar int num_agents: ``N``.
    :ivar int dim: ``d``.
    """

    fn: Callable
    data: Any
    prior_weights: jax.Array
    num_agents: int
    dim: int

    def values(self, x):
        """``(N,)`` local potentials at the agents' iterates ``x`` of shape ``(N, d)``."""
        return jax.vmap(self.fn)(x, self.data, self.prior_weights)

    def grads(self, x):
        """``(N, d)`` gradients of the local potentials at ``x`` of shape ``(N, d)``."""
        return jax.vmap(jax.grad(self.fn))(x, self.data, self.prior_weights)

    def total(self, x):
        """The global potential ``sum_i f_i(x)`` at one point ``x`` of shape ``(d,)``."""
        return jnp.sum(jax.vmap(self.fn, in_axes=(None, 0, 0))(x, self.data, self.prior_weights))


def agent_potentials(potential, prior_weights=None) -> AgentPotentials:
    """The agents' local potentials of a :class:`~numpyro_fed.FederatedPotential`.

    :param prior_weights: ``None`` (the prior split evenly, ``w_i = 1/N``) or ``(N,)``
        non-negative shares summing to one (e.g. all of it on one agent).
    """
    n = potential.num_clients
    if prior_weights is None:
        weights = np.full(n, 1.0 / n)
    else:
        weights = np.asarray(prior_weights, dtype=float)
        if weights.shape != (n,):
            raise ValueError(f"prior_weights must have shape ({n},) (one per client), got {weights.shape}")
        if not np.all(np.isfinite(weights)) or np.any(weights < 0) or not np.isclose(weights.sum(), 1.0):
            raise ValueError(f"prior_weights must be non-negative and sum to one, got {weights.tolist()}")

    def fn(x, block, prior_weight):
        z = potential.unravel(x)
        return potential.client_potential_fn(z, block) + prior_weight * potential.prior_potential_fn(z)

    return AgentPotentials(fn, potential.client_data, jnp.asarray(weights), n, potential.num_latent)


class DecentralisedState(NamedTuple):
    """NumPyro-facing state of a decentralised sampler.

    :ivar i: iteration counter.
    :ivar z: the MCMC sample: the reporting agent's iterate (unconstrained, by site, shaped
        as in the model).
    :ivar agents: every agent's iterate (unconstrained, by site, leading agent axis ``N``).
    :ivar network_average: the average of the agents' iterates on the unconstrained space
        (by site).
    :ivar core: the algorithm's state (e.g. :class:`~numpyro_fed.infer.admm.ADMMState`).
    :ivar info: the algorithm's diagnostics of the last iteration; read them with
        ``extra_fields=("info.<name>",)`` or :meth:`DecentralisedKernel.sample_stats`.
    :ivar rng_key: random key.
    """

    i: jax.Array
    z: dict
    agents: dict
    network_average: dict
    core: Any
    info: Any
    rng_key: jax.Array


class DecentralisedKernel(MCMCKernel):
    """Base class: one agent per client on a communication graph, all agents ``vmap``ped.

    One MCMC sample is one iteration of the network, reported as the iterate of one agent
    (``agent``, agent 0 by default, the agent the D-ADMMS paper evaluates): the agents'
    iterates are the algorithm's draws, each one a draw of the whole parameter. So
    ``MCMC.get_samples()`` has a leading sample axis and the sites' shapes as in the model,
    ready for :class:`~numpyro.infer.Predictive`, and ``MCMC.print_summary()``,
    :func:`~numpyro_fed.to_inference_data` (group ``posterior``) and ``az.summary`` all
    describe these draws. Every agent's iterate is recorded too (:meth:`agent_draws`, the
    ``agents`` group of :func:`~numpyro_fed.to_inference_data`), and so is the network average
    (:meth:`network_average`, the ``network_average`` group). The average is not a posterior
    draw: it is an average of ``N`` draws, so it is narrower than the posterior (by up to a
    factor ``sqrt(N)`` when the agents disagree) and no agent can compute it.

    Chains are independent runs of the whole network; ``chain_method="vectorized"`` runs
    them in one batch.

    Subclasses define :meth:`_build` (the core: ``(init_fn, kernel)``).
    """

    sample_field = "z"
    #: names of the core's per-agent diagnostics (fields of its info namedtuple)
    info_names: tuple = ()

    def __init__(self, model, *, topology="ring", prior_weights=None, init_scale: float = 1.0,
                 partition=None, agent: int = 0):
        self._model = model
        self.topology_spec = topology
        if isinstance(topology, str):  # fail early on an unknown name
            make_topology(topology, 1, warn_disconnected=False)
        self.prior_weights = prior_weights
        self.init_scale = check_positive(init_scale, "init_scale")
        self.partition = partition
        self.agent = check_int(agent, "agent", minimum=0)
        self.federated_potential = None
        self.topology = None
        self._sample_fn = None

    # -- to be provided by the algorithms ---------------------------------------------------
    def _build(self, potentials: AgentPotentials, topology, x0):
        """``(init_fn(x0 (N, d)) -> core, kernel(rng_key, core) -> (core, info))``."""
        raise NotImplementedError

    # -- MCMCKernel -------------------------------------------------------------------------
    @property
    def model(self):
        return self._model

    @property
    def default_fields(self):
        return ("z", "agents", "network_average") + tuple("info." + name for name in self.info_names)

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        batched = not is_prng_key(rng_key)
        first_key = rng_key[0] if batched else rng_key
        potential = split_potential(self._model, model_args, model_kwargs, partition=self.partition,
                                    rng_key=jax.random.fold_in(first_key, 1))
        if self.agent >= potential.num_clients:
            raise ValueError(
                f"agent={self.agent}: the model has {potential.num_clients} clients (agents "
                f"0 .. {potential.num_clients - 1}); choose one of them as the reporting agent"
            )
        self.federated_potential = potential
        self.topology = make_topology(self.topology_spec, potential.num_clients)
        potentials = agent_potentials(potential, self.prior_weights)
        self.agent_potentials = potentials
        n, d = potentials.num_agents, potentials.dim
        base = potential.ravel(potential.init_params)

        def start(key, params):
            if params is None:
                noise = jax.random.normal(key, (n, d), dtype=base.dtype)
                return self.init_scale * noise
            return self._flat_init(params, n, d, base)

        init_fn, kernel = self._build(potentials, self.topology, base)
        self._kernel = kernel

        def one_chain(key, params):
            key_start, key_state = jax.random.split(key)
            x0 = start(key_start, params)
            core = init_fn(x0)
            info = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: kernel(key_start, core)[1]))
            return DecentralisedState(jnp.zeros((), jnp.int32), *self._views(x0), core, info, key_state)

        if batched:
            in_axes = (0, None if init_params is None else 0)
            state = jax.vmap(one_chain, in_axes=in_axes)(rng_key, init_params)
            self._sample_fn = jax.vmap(self._sample)
        else:
            state = one_chain(rng_key, init_params)
            self._sample_fn = self._sample
        return state

    def _sample(self, state):
        key, subkey = jax.random.split(state.rng_key)
        core, info = self._kernel(subkey, state.core)
        return DecentralisedState(state.i + 1, *self._views(core.x), core, info, key)

    def sample(self, state, model_args, model_kwargs):
        return self._sample_fn(state)

    def postprocess_fn(self, model_args, model_kwargs):
        if self.federated_potential is None:
            raise RuntimeError(f"{type(self).__name__}.postprocess_fn needs init() to have run")
        return self.federated_potential.postprocess_fn

    def get_diagnostics_str(self, state):
        return ""

    # -- helpers ----------------------------------------------------------------------------
    def _views(self, x):
        """``(z, agents, network_average)`` of the flat iterates ``x`` (``(N, d)``)."""
        unravel = self.federated_potential.unravel
        return unravel(x[self.agent]), jax.vmap(unravel)(x), unravel(jnp.mean(x, axis=0))

    def _constrain(self, values, batch_ndim):
        """Constrained values of unconstrained ``values`` with ``batch_ndim`` leading axes."""
        leaves = jax.tree.leaves(values)
        batch = jnp.shape(leaves[0])[:batch_ndim]
        flat = jax.tree.map(lambda v: jnp.reshape(v, (-1,) + jnp.shape(v)[batch_ndim:]), values)
        out = jax.vmap(self.federated_potential.postprocess_fn)(flat)
        return jax.tree.map(lambda v: jnp.reshape(v, batch + jnp.shape(v)[1:]), out)

    def _flat_init(self, params, n, d, base):
        """Flat ``(N, d)`` start from ``init_params`` (unconstrained, by site): each site
        shaped like its value (every agent starts there) or with a leading agent axis."""
        reference = self.federated_potential.init_params
        if set(params) != set(reference):
            raise ValueError(f"init_params must have the sites {sorted(reference)}, got {sorted(params)}")
        per_agent = {}
        for name, ref in reference.items():
            shape = jnp.shape(params[name])
            if shape == jnp.shape(ref):
                per_agent[name] = jnp.broadcast_to(params[name], (n,) + shape)
            elif shape == (n,) + jnp.shape(ref):
                per_agent[name] = params[name]
            else:
                raise ValueError(
                    f"init_params[{name!r}] has shape {shape}; expected {jnp.shape(ref)} (all agents) "
                    f"or {(n,) + jnp.shape(ref)} (one value per agent)"
                )
        flat = jax.vmap(self.federated_potential.ravel)(per_agent)
        return jnp.asarray(flat, dtype=base.dtype)

    # -- diagnostics ------------------------------------------------------------------------
    #: what to change when the iterates diverge (named in :meth:`check_run`'s message)
    divergence_advice = "lower the step size"

    #: whether the reporting agent's draws are meant to spread like the posterior (``False``
    #: for an optimiser such as :class:`~numpyro_fed.infer.admm.ADMM`)
    samples_posterior = True
    #: :meth:`check_spread` warns when a coordinate's variance ratio leaves
    #: ``[1/spread_tolerance**2, spread_tolerance**2]`` or its mean is more than
    #: ``offset_tolerance`` posterior sds off (Stein's identity, see there)
    spread_tolerance = 2.0
    offset_tolerance = 1.0

    def check_run(self, mcmc, *, strict: bool = False) -> int:
        """Warns (or raises ``RuntimeError`` with ``strict``) when agents' iterates are not
        finite, i.e. the run diverged, and when the draws' spread is far from the posterior's
        (:meth:`check_spread`). :func:`~numpyro_fed.to_inference_data` calls it.

        :return: the number of non-finite agent iterates (over chains, iterations, agents).
        """
        bad = self._check_finite(mcmc, strict)
        if not bad:
            self.check_spread(mcmc, strict=strict)
        return bad

    def check_spread(self, mcmc, *, strict: bool = False):
        """Checks the reporting agent's draws against the posterior with Stein's identity,
        coordinate by coordinate on the unconstrained space, and warns (or raises with
        ``strict``) when they are far off, since these samplers are biased (D-ADMMS's injected
        noise does not follow the posterior's width: at the default ``rho`` its iterates were
        0.66 of the posterior sd on 250 rows and 0.17 on 10,000) and nothing else would say
        so.

        Under the posterior ``E[d_i U(x)] = 0`` and ``E[(x_i - m_i) d_i U(x)] = 1`` for any
        smooth target (integration by parts), so over the draws ``stein_scale = mean((x_i -
        m_i) d_i U(x))`` (``m`` the draws' mean) and ``stein_mean = mean(d_i U(x)) *
        sd_i(x)`` should be 1 and 0. For a Gaussian posterior and Gaussian draws,
        ``stein_scale`` is the draws' variance over the posterior's and ``stein_mean /
        sqrt(stein_scale)`` the offset of their mean in posterior sds; no mode or Gaussian
        shape is needed for the identity itself (a funnel is checked too). ``d_i U`` is the
        gradient of the global potential, an aggregate of the agents' gradients at every
        draw: the check is a diagnostic of the simulation driver, not a message of the
        algorithm.

        :return: ``(stein_mean, stein_scale)``, each ``(d,)`` (``None`` when not checked: the
            noise-free :class:`~numpyro_fed.infer.admm.ADMM`, fewer than 20 draws).
        """
        if not self.samples_posterior:
            return None
        values = mcmc.get_extra_fields().get("agents")
        if values is None:
            return None
        ravel = self.federated_potential.ravel
        draws = jax.vmap(ravel)(jax.tree.map(lambda v: v[:, self.agent], values))
        if draws.shape[0] < 20 or not bool(jnp.all(jnp.isfinite(draws))):
            return None
        grads = np.asarray(jax.device_get(jax.lax.map(jax.grad(self.agent_potentials.total), draws,
                                                       batch_size=256)), dtype=np.float64)
        x = np.asarray(jax.device_get(draws), dtype=np.float64)
        deviation = x - x.mean(0)
        stein_scale = np.mean(deviation * grads, axis=0)
        stein_mean = np.mean(grads, axis=0) * x.std(0)
        with np.errstate(divide="ignore", invalid="ignore"):
            offset = np.abs(stein_mean) / np.sqrt(np.maximum(stein_scale, 1e-300))
            bad_scale = ~((stein_scale >= self.spread_tolerance ** -2) & (stein_scale <= self.spread_tolerance ** 2))
        bad = bad_scale | ~(offset <= self.offset_tolerance)
        if bad.any():
            j = int(np.argmax(np.where(bad, np.abs(np.log(np.abs(stein_scale) + 1e-300)) + offset, -np.inf)))
            message = (
                f"{type(self).__name__}: agent {self.agent}'s draws do not match the posterior's score "
                f"(Stein's identity, unconstrained coordinate {j} of {x.shape[1]}: variance ratio "
                f"about {stein_scale[j]:.3g}, mean about {offset[j]:.2g} posterior sds off; "
                f"{int(bad.sum())} coordinate(s) outside a factor {self.spread_tolerance:g} in sd or "
                f"{self.offset_tolerance:g} sd in mean): this sampler is biased and its draws are "
                f"not the posterior's here. {self.spread_advice}"
            )
            if strict:
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return stein_mean, stein_scale

    #: what to change when the draws are off (named in :meth:`check_spread`'s message)
    spread_advice = ("Treat the draws as approximate; for calibrated uncertainty use FedZigZag (exact), "
                     "and reparametrise hierarchical models non-centred (numpyro.infer.reparam."
                     "LocScaleReparam) where the draws collapse a scale")

    def _check_finite(self, mcmc, strict):
        values = mcmc.get_extra_fields().get("agents")
        if values is None:
            return 0
        bad = np.zeros((), dtype=np.int64)
        total = 0
        for v in jax.tree.leaves(values):
            v = np.asarray(jax.device_get(v))
            per_iterate = ~np.isfinite(v.reshape(v.shape[:2] + (-1,))).all(-1)
            bad = bad + per_iterate.sum()
            total = per_iterate.size
        bad = int(bad)
        if bad:
            message = (
                f"{type(self).__name__}: {bad} of {total} agent iterates are not finite (the run "
                f"diverged); {self.divergence_advice}"
            )
            if strict:
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return bad

    def sample_stats(self, extra_fields):
        """Diagnostics by name from ``MCMC.get_extra_fields(group_by_chain=True)``:
        ``{name: (array, dims)}``, per-agent ones with an ``agent`` dim."""
        stats = {}
        for name in self.info_names:
            value = extra_fields.get("info." + name)
            if value is None:
                continue
            value = np.asarray(jax.device_get(value))
            stats[name] = (value, ["agent"] if value.ndim == 3 else [])
        return stats

    def extra_groups(self, mcmc):
        """The groups :func:`~numpyro_fed.to_inference_data` adds beside ``posterior`` (which
        holds ``mcmc.get_samples()``, the reporting agent's draws): ``{group: (values,
        leading_dims)}`` with every agent's draws in ``agents`` (an ``agent`` dim before the
        sites' own dims) and the network average in ``network_average``."""
        agents = {k: np.asarray(v) for k, v in
                  jax.device_get(self.agent_draws(mcmc, group_by_chain=True)).items()}
        average = {k: np.asarray(v) for k, v in
                   jax.device_get(self.network_average(mcmc, group_by_chain=True)).items()}
        return {"agents": (agents, ["agent"]), "network_average": (average, [])}

    @staticmethod
    def agent_draws(mcmc, agent: int | None = None, *, group_by_chain: bool = False) -> dict:
        """Constrained draws by site of agent ``agent`` (shaped like ``mcmc.get_samples()``,
        ready for :class:`~numpyro.infer.Predictive`), or of all agents (``agent=None``: an
        agent axis after the sample axes). Call it on the class or on the kernel:
        ``DADMMS.agent_draws(mcmc, 2)``.

        :param mcmc: a :class:`~numpyro.infer.MCMC` that ran a decentralised sampler.
        :param bool group_by_chain: keep the chain axis, as in ``mcmc.get_samples``.
        """
        kernel = DecentralisedKernel._kernel_of(mcmc)
        values = mcmc.get_extra_fields(group_by_chain=group_by_chain).get("agents")
        if values is None:
            raise ValueError("this MCMC run did not record the agents' iterates (the 'agents' field)")
        batch_ndim = 3 if group_by_chain else 2
        if agent is not None:
            n = kernel.federated_potential.num_clients
            if isinstance(agent, bool) or not isinstance(agent, (int, np.integer)) or not 0 <= agent < n:
                raise ValueError(f"agent must be an integer in 0 .. {n - 1} (or None for all agents), got {agent!r}")
            values = jax.tree.map(lambda v: jnp.take(v, int(agent), axis=batch_ndim - 1), values)
            batch_ndim -= 1
        return kernel._constrain(values, batch_ndim)

    @staticmethod
    def network_average(mcmc, *, group_by_chain: bool = False) -> dict:
        """The network average of the agents' iterates by site (averaged on the
        unconstrained space, then constrained), shaped like ``mcmc.get_samples()``. It is a
        diagnostic of consensus, not a posterior draw: an average of ``N`` draws is narrower
        than the posterior."""
        kernel = DecentralisedKernel._kernel_of(mcmc)
        values = mcmc.get_extra_fields(group_by_chain=group_by_chain).get("network_average")
        if values is None:
            raise ValueError("this MCMC run did not record the network average (the 'network_average' field)")
        return kernel._constrain(values, 2 if group_by_chain else 1)

    @staticmethod
    def _kernel_of(mcmc):
        kernel = getattr(mcmc, "sampler", None)
        if not isinstance(kernel, DecentralisedKernel):
            raise TypeError(f"expected an MCMC run of a decentralised sampler (DADMMS, DSGLD, ...), got {mcmc!r}")
        if kernel.federated_potential is None:
            raise RuntimeError("run the MCMC first")
        return kernel
