"""The NumPyro face of every decentralized sampler: :class:`DecentralizedKernel`.

One MCMC sample per iteration of the network is one agent's iterate (site shapes as in the
model, so ``MCMC.get_samples()`` goes straight into :class:`~numpyro.infer.Predictive`), and
every agent's iterate and the network average are recorded beside it. The algorithm is a
pure core, ``init_fn(x0) -> state`` and an
:class:`~numpyro_fed.federation.decentralized.AgentProgram` (what one agent runs), that a
subclass returns from :meth:`DecentralizedKernel.build_core`; the federation's network runs
it (:meth:`Federation.agent_network <numpyro_fed.federation.Federation.agent_network>`: every
agent ``vmap``-ped in this process, or one Ray actor per agent).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.util import is_prng_key

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.federation import MessageLedger
from numpyro_fed.federation.decentralized import NetworkState, deliver, info_struct
from numpyro_fed.infer.admm.agents import AgentPotentials, agent_potentials
from numpyro_fed.infer.admm.scaling import stein_spread
from numpyro_fed.infer.admm.topology import make_topology
from numpyro_fed.infer.kernel import FederatedMCMCKernel, RunCheck, warn_or_raise

__all__ = ["DecentralizedKernel", "DecentralizedState", "SentCounts"]


class DecentralizedState(NamedTuple):
    """NumPyro-facing state of a decentralized sampler.

    :ivar i: iteration counter.
    :ivar z: the MCMC sample: the reporting agent's iterate (unconstrained, by site, shaped
        as in the model).
    :ivar agents: every agent's iterate (unconstrained, by site, leading agent axis ``N``).
    :ivar network_average: the average of the agents' iterates on the unconstrained space
        (by site).
    :ivar core: the algorithm's state (e.g. :class:`~numpyro_fed.infer.admm.dadmms.ADMMState`).
    :ivar info: the algorithm's diagnostics of the last iteration; read them with
        ``extra_fields=("info.<name>",)`` or :meth:`DecentralizedKernel.sample_stats`.
    :ivar rng_key: the chain's random key (constant through a run: agent ``m`` draws the
        noise of iteration ``t`` from ``fold_in(fold_in(rng_key, m), t)``).
    :ivar sent: :class:`SentCounts`, what each agent has sent its neighbors since the
        network started (one chain's network).
    """

    i: jax.Array
    z: dict
    agents: dict
    network_average: dict
    core: Any
    info: Any
    rng_key: jax.Array
    sent: Any


class SentCounts(NamedTuple):
    """Cumulative counts per agent (each ``(N,)``) of the messages an agent sent to its
    neighbors and of their bytes (the arrays' bytes, one chain's network): the ledger of the
    decentralized exchange. In this process they follow from the topology and the message's
    shape; on Ray the agents count what they really send."""

    messages: jax.Array
    bytes: jax.Array


class DecentralizedKernel(FederatedMCMCKernel):
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

    **Adding an algorithm**: subclass, set :attr:`info_names` and return the core from
    :meth:`build_core`: what one agent runs, an
    :class:`~numpyro_fed.federation.decentralized.AgentProgram` of its own data, its own state
    and its neighbors' messages; the face does the rest, on every backend. Here, gossip
    averaging (each agent moves to the mean of itself and its neighbors: a consensus
    algorithm, not a sampler):

    >>> from typing import NamedTuple
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> from numpyro_fed.federation.decentralized import AgentProgram
    >>> from numpyro_fed.infer.admm import DecentralizedKernel
    >>> class GossipState(NamedTuple):  # one agent's own state (stacked: a leading agent axis)
    ...     x: jax.Array
    >>> class GossipInfo(NamedTuple):
    ...     distance_to_neighbors: jax.Array
    >>> def send(local, key, own, inbox, mask):  # inbox: the neighbors' iterates (rows past mask are 0)
    ...     x = (own.x + inbox.sum(0)) / (1 + mask.sum())
    ...     return x, x  # (what receive gets, the message each neighbor gets)
    >>> def receive(local, x, inbox, previous_inbox, mask):  # inbox: the neighbors' new iterates
    ...     distance = jnp.max(jnp.where(mask, jnp.abs(inbox - x).max(-1), 0.0))
    ...     return GossipState(x), GossipInfo(distance)
    >>> class Gossip(DecentralizedKernel):
    ...     info_names = GossipInfo._fields
    ...     samples_posterior = False  # no spread check: it is not a sampler
    ...     def build_core(self, potentials, topology, x0):
    ...         # local: what each agent alone holds (leading agent axis); gossip needs nothing
    ...         program = AgentProgram(lambda own: own.x, send, receive, local=jnp.zeros(topology.num_agents))
    ...         return GossipState, program
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", y.shape[0], clients=4):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> mcmc = MCMC(Gossip(model, topology="ring"), num_warmup=0, num_samples=30, progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(0), jnp.zeros(8))
    >>> Gossip.agent_draws(mcmc)["mu"].shape, mcmc.get_extra_fields()["info.distance_to_neighbors"].shape
    ((30, 4), (30, 4))
    >>> bool(mcmc.get_extra_fields()["info.distance_to_neighbors"][-1].max() < 1e-6)  # consensus
    True
    """

    client_dim = "agent"
    #: what to change when the iterates diverge (named in :meth:`check_run`'s message)
    divergence_advice = "lower the step size"
    #: whether the reporting agent's draws are meant to spread like the posterior (``False``
    #: for an optimizer such as :class:`~numpyro_fed.ADMM`)
    samples_posterior = True
    #: :meth:`check_spread` warns when a coordinate's variance ratio leaves
    #: ``[1/spread_tolerance**2, spread_tolerance**2]`` or its mean is more than
    #: ``offset_tolerance`` posterior sds off (Stein's identity, see there)
    spread_tolerance = 2.0
    offset_tolerance = 1.0
    #: what to change when the draws are off (named in :meth:`check_spread`'s message)
    spread_advice = (
        "Treat the draws as approximate; for calibrated uncertainty use FedZigZag (exact), "
        "and reparametrize hierarchical models non-centered (numpyro.infer.reparam."
        "LocScaleReparam) where the draws collapse a scale"
    )

    def __init__(
        self,
        model,
        *,
        topology="ring",
        prior_weights=None,
        init_scale: float = 1.0,
        partition=None,
        agent: int = 0,
        federation=None,
    ):
        super().__init__(model, partition=partition, federation=federation)  # the agents run on it
        self._network = None
        if isinstance(topology, str):  # fail early on an unknown name
            make_topology(topology, 1, warn_disconnected=False)
        #: the ``topology`` argument; :attr:`graph` is the graph built from it by ``init``
        self.topology = topology
        self.graph = None
        self.prior_weights = prior_weights
        self.init_scale = check_positive(init_scale, "init_scale")
        self.agent = check_int(agent, "agent", minimum=0)
        self.agent_potentials = None
        #: ``None`` (the core iterates the model's flat unconstrained coordinates) or ``(center,
        #: transform, inverse)`` set by :meth:`build_core`: the core iterates ``y`` with ``x =
        #: center + transform @ y`` (e.g. D-ADMMS with ``rho="auto"``, in the posterior's units)
        self.coordinates = None

    # -- the algorithm ----------------------------------------------------------------------
    def build_core(self, potentials: AgentPotentials, topology, x0):
        """The algorithm's core: ``(init_fn, program)`` with ``init_fn(x0) -> state`` the
        agents' own states (stacked, leading axis ``N``) at their starting iterates ``x0``
        (``(N, d)``), and ``program`` an
        :class:`~numpyro_fed.federation.decentralized.AgentProgram`, what one agent runs (its
        own state has its iterate as ``x``; its info is a namedtuple with fields
        :attr:`info_names`). The federation's network runs it, every agent drawing its
        iteration ``t``'s noise from ``fold_in(fold_in(rng_key, agent), t)``.

        :param AgentPotentials potentials: the agents' local potentials.
        :param topology: the :class:`~numpyro_fed.infer.admm.topology.Topology`.
        :param x0: ``(d,)`` a point where the potentials are finite.
        """
        raise NotImplementedError

    # -- MCMCKernel -------------------------------------------------------------------------
    @property
    def default_fields(self):
        return (
            ("z", "agents", "network_average")
            + tuple("info." + name for name in self.info_names)
            + ("sent.messages", "sent.bytes")
        )

    def sample_stats(self, extra_fields) -> dict:
        """The core's diagnostics (see :meth:`~numpyro_fed.infer.kernel.FederatedMCMCKernel.sample_stats`)
        and the ledger of the exchange: ``messages_to_peer`` and ``bytes_to_peer``, each agent's
        cumulative count of what it sent its neighbors (one chain's network) up to each draw."""
        stats = super().sample_stats(extra_fields)
        for field, name in (("sent.messages", "messages_to_peer"), ("sent.bytes", "bytes_to_peer")):
            value = extra_fields.get(field)
            if value is not None:
                stats[name] = (np.asarray(jax.device_get(value)), [self.client_dim])
        return stats

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        batched = not is_prng_key(rng_key)
        first_key = rng_key[0] if batched else rng_key
        potential = self.init_potential(jax.random.fold_in(first_key, 1), model_args, model_kwargs)
        if self.agent >= potential.num_clients:
            raise ValueError(
                f"agent={self.agent}: the model has {potential.num_clients} clients (agents "
                f"0 .. {potential.num_clients - 1}); choose one of them as the reporting agent"
            )
        # the backend runs the agents (it refuses if it cannot: a hub-and-spoke engine)
        federation = self.federation
        self.graph = make_topology(self.topology, potential.num_clients)
        adjacency = np.asarray(self.graph.adjacency)
        potentials = self.agent_potentials = self._agent_potentials(federation, potential, adjacency)
        n, d = potentials.num_agents, potentials.dim
        base = potential.ravel(potential.init_params)
        self.coordinates = None
        init_fn, program = self.build_core(potentials, self.graph, base)
        network = self._network = federation.agent_network(
            program, adjacency, name=type(self).__name__, settings=self._settings(), previous=self._network
        )
        network.describe = lambda resume, history: self._describe_failure(program, adjacency, batched, resume, history)
        step = network.sampler_step(batched)
        start_core = lambda x0: network.start(init_fn(x0))  # noqa: E731
        state_struct = jax.eval_shape(start_core, jax.ShapeDtypeStruct((n, d), base.dtype))
        info_shape = info_struct(program, adjacency, network.local_struct(), state_struct)
        degrees = np.asarray(self.graph.degrees, dtype=np.int64)
        message_bytes = d * base.dtype.itemsize

        def start(key, params):
            if params is None:  # in the core's coordinates (the posterior's units, if it has them)
                return self.init_scale * jax.random.normal(key, (n, d), dtype=base.dtype)
            x = self._flat_init(params, n, d, base)
            if self.coordinates is None:
                return x
            center, _, inverse = self.coordinates
            return (x - jnp.asarray(center, base.dtype)) @ jnp.asarray(inverse, base.dtype).T

        def one_chain(key, params):
            k_start, k_chain = jax.random.split(key)
            x0 = start(k_start, params)
            info = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), info_shape)
            # the network starts with every agent sending its iterate to each neighbor
            sent = SentCounts(jnp.asarray(degrees), jnp.asarray(degrees * message_bytes))
            return DecentralizedState(jnp.zeros((), jnp.int32), *self._views(x0), start_core(x0), info, k_chain, sent)

        views = jax.vmap(self._views) if batched else self._views

        def sample(state):
            core_state, info, sent = step(state.rng_key, state.i, state.core, state.sent)
            return DecentralizedState(state.i + 1, *views(core_state.x), core_state, info, state.rng_key, sent)

        self._sample_fn = sample
        if batched:
            return jax.vmap(one_chain, in_axes=(0, None if init_params is None else 0))(rng_key, init_params)
        return one_chain(rng_key, init_params)

    def _agent_potentials(self, federation, potential, adjacency) -> AgentPotentials:
        """The agents' potentials: from the pooled blocks (simulation), from the blocks the
        clients loaded in this process (a federation ``in_process`` with a loader), or reaching
        agents that loaded their own blocks on their workers (deployment on an engine: the
        agents are started here, before the algorithm asks them its set-up questions)."""
        if not potential.deployed:
            return agent_potentials(potential, self.prior_weights)
        if federation.in_process:
            federation.start(potential.client_program({}))
            return agent_potentials(potential, self.prior_weights, data=federation.blocks)
        hosts = self._network = federation.agent_hosts(
            potential.block_loader, adjacency, name=type(self).__name__, previous=self._network
        )
        pots = agent_potentials(potential, self.prior_weights)
        return pots._replace(ask=hosts.agent_ask(pots.prior_weights))

    def _settings(self) -> str:
        """The arguments that shape the agents' functions (not the federation, whose ``repr``
        changes once it runs)."""
        values = {k: v for k, v in self.hyperparameters().items() if k != "federation"}
        return f"{type(self).__name__}{sorted(values.items(), key=lambda kv: kv[0])!r}"

    def _describe_failure(self, program, adjacency, batched, resume, history):
        """``(state, draws)`` of a run that a fault stopped: the state at the last completed
        iteration (resumable) and every agent's iterates since the network started."""
        own = jax.tree.map(jnp.asarray, resume["own"])
        keys = jnp.asarray(resume["keys"])
        chains = keys.shape[0]
        x = own.x
        core = NetworkState(own, jax.vmap(lambda v: deliver(adjacency, v))(x))
        shapes = info_struct(program, adjacency, self._network.local_struct(), jax.tree.map(lambda a: a[0], core))
        info = jax.tree.map(lambda s: jnp.zeros((chains,) + s.shape, s.dtype), shapes)
        sent = SentCounts(jnp.asarray(resume["sent"][:, 0]), jnp.asarray(resume["sent"][:, 1]))
        i = jnp.full((chains,), resume["i"], jnp.int32)
        state = DecentralizedState(i, *jax.vmap(self._views)(x), core, info, keys, sent)
        if not batched:
            state = jax.tree.map(lambda a: a[0], state)
        draws = None
        if history:
            flat = self._to_model(jnp.stack([jnp.asarray(h[1].x) for h in history], axis=1))  # (C, T, N, d)
            draws = self._constrain(jax.vmap(jax.vmap(jax.vmap(self.federated_potential.unravel)))(flat), 3)
        return state, draws

    # -- helpers ----------------------------------------------------------------------------
    def _to_model(self, x):
        """The core's flat iterates ``x`` (``(..., d)``) in the model's flat unconstrained
        coordinates (see :attr:`coordinates`)."""
        if self.coordinates is None:
            return x
        center, transform, _ = self.coordinates
        return jnp.asarray(center, x.dtype) + x @ jnp.asarray(transform, x.dtype).T

    def _views(self, x):
        """``(z, agents, network_average)`` of the core's flat iterates ``x`` (``(N, d)``)."""
        unravel = self.federated_potential.unravel
        x = self._to_model(x)
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
    def diagnose(self, mcmc) -> RunCheck:
        """Non-finite agent iterates (the run diverged) and, when there are none, draws whose
        spread is far from the posterior's (:meth:`check_spread`). :meth:`check_run` returns
        the number of non-finite agent iterates (over chains, iterations, agents)."""
        bad, total = self._count_nonfinite(mcmc)
        problems = []
        if bad:
            problems.append(
                f"{bad} of {total} agent iterates are not finite (the run diverged); {self.divergence_advice}"
            )
        else:
            message, _ = self._spread(mcmc)
            if message:
                problems.append(message)
        return RunCheck(problems, bad)

    def check_spread(self, mcmc, *, strict: bool = False):
        """Checks the reporting agent's draws against the posterior with Stein's identity,
        coordinate by coordinate on the unconstrained space, and warns (or raises with
        ``strict``) when they are far off, since these samplers are biased (D-ADMMS's injected
        noise does not follow the posterior's width: at the default ``rho`` its iterates were
        0.66 of the posterior sd on 250 rows and 0.17 on 10,000) and nothing else would say
        so. :meth:`check_run` includes this check.

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
            noise-free :class:`~numpyro_fed.ADMM`, fewer than 20 draws).
        """
        message, result = self._spread(mcmc)
        if message:
            warn_or_raise(f"{type(self).__name__}: {message}", strict=strict)
        return result

    def _spread(self, mcmc):
        """``(message or None, (stein_mean, stein_scale) or None)``: see :meth:`check_spread`."""
        if not self.samples_posterior:
            return None, None
        values = mcmc.get_extra_fields().get("agents")
        if values is None:
            return None, None
        ravel = self.federated_potential.ravel
        draws = jax.vmap(ravel)(jax.tree.map(lambda v: v[:, self.agent], values))
        if draws.shape[0] < 20 or not bool(jnp.all(jnp.isfinite(draws))):
            return None, None
        potentials = self.agent_potentials
        if potentials.deployed:
            # each agent's gradients at the draws, computed where it lives (a diagnostic call)
            per_agent = potentials.per_agent("diagnostics", partial(_grads_at, potentials.fn), draws)
            grads = np.asarray(jax.device_get(per_agent), dtype=np.float64).sum(0)
        else:
            grads = np.asarray(
                jax.device_get(jax.lax.map(jax.grad(potentials.total), draws, batch_size=256)), dtype=np.float64
            )
        x = np.asarray(jax.device_get(draws), dtype=np.float64)
        variance_ratio, offset = stein_spread(x, grads)
        stein_scale = variance_ratio
        stein_mean = offset * np.sqrt(np.abs(variance_ratio))
        with np.errstate(invalid="ignore"):
            bad_scale = ~((variance_ratio >= self.spread_tolerance**-2) & (variance_ratio <= self.spread_tolerance**2))
        bad = bad_scale | ~(np.abs(offset) <= self.offset_tolerance)
        message = None
        if bad.any():
            score = np.abs(np.log(np.abs(np.nan_to_num(variance_ratio, nan=1e-300)) + 1e-300))
            j = int(np.argmax(np.where(bad, score + np.nan_to_num(np.abs(offset), nan=1e3), -np.inf)))
            if np.isfinite(variance_ratio[j]) and variance_ratio[j] > 0:
                measured = (
                    f"sd ratio about {np.sqrt(variance_ratio[j]):.2g} (variance ratio {variance_ratio[j]:.2g}), "
                    f"mean about {abs(offset[j]):.2g} posterior sds off"
                )
            else:
                measured = "the draws are too far from the posterior for Stein's identity to measure a spread"
            message = (
                f"agent {self.agent}'s draws do not match the posterior's score "
                f"(Stein's identity, {self.federated_potential.coordinate_names[j]} unconstrained, coordinate "
                f"{j} of {x.shape[1]}: {measured}; "
                f"{int(bad.sum())} coordinate(s) outside a factor {self.spread_tolerance:g} in sd or "
                f"{self.offset_tolerance:g} sd in mean): this sampler is biased and its draws are "
                f"not the posterior's here. {self.spread_advice}"
            )
        return message, (stein_mean, stein_scale)

    def _count_nonfinite(self, mcmc):
        values = mcmc.get_extra_fields().get("agents")
        if values is None:
            return 0, 0
        # an iterate (one agent, iteration and chain) is bad when any of its sites is not finite
        bad = None
        for v in jax.tree.leaves(values):
            v = np.asarray(jax.device_get(v))
            per_iterate = ~np.isfinite(v.reshape(v.shape[:2] + (-1,))).all(-1)
            bad = per_iterate if bad is None else bad | per_iterate
        if bad is None:
            return 0, 0
        return int(bad.sum()), int(bad.size)

    # -- what to_inference_data reads -------------------------------------------------------
    def extra_groups(self, mcmc):
        """The groups :func:`~numpyro_fed.to_inference_data` adds beside ``posterior`` (which
        holds ``mcmc.get_samples()``, the reporting agent's draws): ``{group: (values,
        leading_dims)}`` with every agent's draws in ``agents`` (an ``agent`` dim before the
        sites' own dims) and the network average in ``network_average``."""
        agents = {k: np.asarray(v) for k, v in jax.device_get(self.agent_draws(mcmc, group_by_chain=True)).items()}
        average = {k: np.asarray(v) for k, v in jax.device_get(self.network_average(mcmc, group_by_chain=True)).items()}
        return {"agents": (agents, ["agent"]), "network_average": (average, [])}

    def message_ledger(self, mcmc) -> dict:
        """What crossed the network in ``mcmc``'s run since it started (warm-up included),
        per agent: ``{name: (M,) int array}`` with the names of :meth:`MessageLedger.summary
        <numpyro_fed.federation.MessageLedger.summary>` (the shape of
        :meth:`FedZigZag.message_ledger <numpyro_fed.FedZigZag.message_ledger>` and of a
        variational run's :attr:`RunResult.ledger <numpyro_fed.infer.RunResult.ledger>`), from what
        the sampler counted (:class:`SentCounts` of the last state, summed over chains), on
        any backend: totals (``messages_to_peer``, ``bytes_to_peer``, ``rounds``) and the same
        per entry, prefixed ``"<Sampler>/start/"`` (each agent's starting iterate to each
        neighbor) and ``"<Sampler>/iterate/"`` (one message per neighbor and iteration).
        On Ray, ``federation.ledger`` counts the same messages from the payloads (and the
        iterations the agents ran ahead of the draws kept)."""
        kernel = self._kernel_of(mcmc)
        state = mcmc.last_state
        sent = jax.device_get(state.sent)
        messages = np.asarray(sent.messages).reshape(-1, kernel.graph.num_agents)
        nbytes = np.asarray(sent.bytes).reshape(-1, kernel.graph.num_agents)
        iterations = np.asarray(state.i).reshape(-1)
        chains = messages.shape[0]
        degrees = np.asarray(kernel.graph.degrees, dtype=np.int64)
        per_message = nbytes // np.maximum(messages, 1)
        name = type(kernel).__name__
        ledger = MessageLedger(kernel.graph.num_agents)
        ledger.add(
            f"{name}/start", "to_peer", None, messages=degrees * chains, nbytes=(degrees * per_message).sum(0), rounds=1
        )
        ledger.add(
            f"{name}/iterate",
            "to_peer",
            None,
            messages=messages.sum(0) - degrees * chains,
            nbytes=nbytes.sum(0) - (degrees * per_message).sum(0),
            rounds=int(iterations.max()),
        )
        kernel.record_setup(ledger)
        return ledger.summary()

    def record_setup(self, ledger) -> None:
        """Adds the set-up's messages of the last run to ``ledger`` (a
        :class:`~numpyro_fed.federation.MessageLedger`; none here)."""

    @staticmethod
    def agent_draws(mcmc, agent: int | None = None, *, group_by_chain: bool = False) -> dict:
        """Constrained draws by site of agent ``agent`` (shaped like ``mcmc.get_samples()``,
        ready for :class:`~numpyro.infer.Predictive`), or of all agents (``agent=None``: an
        agent axis after the sample axes). Call it on the class or on the kernel:
        ``DADMMS.agent_draws(mcmc, 2)``.

        :param mcmc: a :class:`~numpyro.infer.MCMC` that ran a decentralized sampler.
        :param bool group_by_chain: keep the chain axis, as in ``mcmc.get_samples``.
        """
        kernel = DecentralizedKernel._kernel_of(mcmc)
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
        kernel = DecentralizedKernel._kernel_of(mcmc)
        values = mcmc.get_extra_fields(group_by_chain=group_by_chain).get("network_average")
        if values is None:
            raise ValueError("this MCMC run did not record the network average (the 'network_average' field)")
        return kernel._constrain(values, 2 if group_by_chain else 1)

    @staticmethod
    def _kernel_of(mcmc):
        kernel = getattr(mcmc, "sampler", None)
        if not isinstance(kernel, DecentralizedKernel):
            raise TypeError(f"expected an MCMC run of a decentralized sampler (DADMMS, DSGLD, ...), got {mcmc!r}")
        if kernel.federated_potential is None:
            raise RuntimeError("run the MCMC first")
        return kernel


def _grads_at(fn, block, prior_weight, draws):
    """One agent's gradients of its potential at ``draws`` (``(T, d)``)."""
    grad = jax.grad(fn)
    return jax.lax.map(lambda x: grad(x, block, prior_weight), draws, batch_size=256)
