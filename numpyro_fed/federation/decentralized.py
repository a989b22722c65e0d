"""Decentralized exchange: agents that send their iterates to their neighbours, with no server.

A decentralized algorithm (D-ADMMS and its baselines) is an :class:`AgentProgram`: three
pure functions of **one** agent (its own data, its own state, what its neighbours sent), and
the per-agent data ``local`` (a pytree with a leading agent axis ``N``; agent ``m`` only ever
gets its slice). One iteration of agent ``m``:

1. ``send(local_m, key, own, inbox, mask) -> (pending, message)``: compute from its own
   state and the messages of its neighbours it holds (``inbox``), then send ``message`` to
   every neighbour;
2. receive the neighbours' new messages (the new ``inbox``);
3. ``receive(local_m, pending, inbox, previous_inbox, mask) -> (own, info)``.

``inbox`` is ``(D, *message_shape)`` (``D`` the largest degree): row ``r`` holds the latest
message of agent ``m``'s ``r``-th neighbour (in increasing order, see :func:`neighbors`) where
``mask[r]`` is true, zeros past its degree. A network
is started (or restarted, e.g. to resume a run) from every agent's own state alone: each
agent sends ``message(own)`` to its neighbours, so the driver never hands an agent another
agent's iterate. The network's state is :class:`NetworkState` (own states and inboxes).

The program is the algorithm's one core; a backend's network runs it
(:meth:`Federation.agent_network <numpyro_fed.federation.Federation.agent_network>`), and
every network runs the same program with the same numbers:

* :class:`InProcessNetwork` (:class:`~numpyro_fed.federation.InProcess`'s): every agent
  ``vmap``-ped, the exchange an indexing of the stacked messages (:func:`deliver`), compiled
  into the caller's ``jit``;
* :class:`~numpyro_fed.federation.ray_agents.RayNetwork`
  (:class:`~numpyro_fed.federation.RayFederation`'s): one Ray actor per agent holding its
  ``local`` slice and handles to its neighbours' actors; each actor runs its own loop of
  iterations and sends its message straight to its neighbours' actors. The driver starts the
  loops and collects every agent's state per iteration (the draws); it never relays a message.

A network's ``sampler_step(batched)`` is the iteration a sampler's compiled loop calls:
``step(rng_key, i, state, sent) -> (state, info, sent)`` for a chain's key, its iteration
``i``, its :class:`NetworkState` and ``sent``, a namedtuple ``(messages, bytes)`` of ``(N,)``
counts of what each agent sent its neighbours so far (a leading chain axis on each with
``batched``).

Randomness: agent ``m`` draws its noise of iteration ``t`` from
``fold_in(fold_in(rng_key, m), t)`` (:func:`agent_keys`), so each agent draws its own noise and
the two networks draw the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.federation.base import tree_nbytes

__all__ = [
    "AgentProgram",
    "InProcessNetwork",
    "NetworkState",
    "agent_keys",
    "attached_struct",
    "deliver",
    "info_struct",
    "neighbors",
    "network_iteration",
    "start_network",
]


class AgentProgram(NamedTuple):
    """What every agent of a decentralized algorithm runs (see the module's docstring).

    :ivar message: ``own -> message``: what an agent sends when a network starts.
    :ivar send: ``(local, key, own, inbox, mask) -> (pending, message)``.
    :ivar receive: ``(local, pending, inbox, previous_inbox, mask) -> (own, info)``.
    :ivar local: per-agent data, a pytree with a leading agent axis ``N``.
    :ivar attach: deployment (the agents load their own rows): ``(block, local_m) ->
        local_m``, run where agent ``m`` lives on the block it loaded and its slice of
        ``local`` (which then holds what the driver knows: prior shares, mixing weights...),
        giving what ``send`` and ``receive`` take. ``None`` in simulation (``local`` holds the
        blocks).
    """

    message: Callable
    send: Callable
    receive: Callable
    local: Any
    attach: Callable | None = None


class NetworkState(NamedTuple):
    """The state of a network of ``N`` agents.

    :ivar own: every agent's own state (a pytree, leading axis ``N``).
    :ivar inbox: ``(N, D, *message_shape)``: row ``m`` is agent ``m``'s inbox.
    """

    own: Any
    inbox: jax.Array

    @property
    def x(self):
        """The agents' iterates ``own.x`` (``(N, d)``)."""
        return self.own.x


def neighbors(adjacency):
    """``(index, valid)``, each ``(N, D)`` with ``D`` the largest degree (at least 1): row
    ``m`` lists agent ``m``'s neighbours in increasing order, padded with 0 where ``valid`` is
    false. The layout of every inbox.

    >>> index, valid = neighbors(np.array([[0, 1, 1], [1, 0, 0], [1, 0, 0]]))
    >>> index.tolist(), valid.tolist()
    ([[1, 2], [0, 0], [0, 0]], [[True, True], [True, False], [True, False]])
    """
    linked = np.asarray(adjacency) != 0
    width = max(int(linked.sum(axis=1).max(initial=0)), 1)
    index = np.zeros((linked.shape[0], width), dtype=np.int32)
    valid = np.zeros((linked.shape[0], width), dtype=bool)
    for m, row in enumerate(linked):
        k = np.flatnonzero(row)
        index[m, : len(k)] = k
        valid[m, : len(k)] = True
    return index, valid


def deliver(adjacency, messages):
    """Every agent's inbox: ``(N, D, *message_shape)``, row ``r`` of agent ``m``'s the message
    of its ``r``-th neighbour (see :func:`neighbors`; zeros past its degree). ``adjacency``
    is concrete (the topology is static): the in-process network.

    >>> deliver(np.array([[0.0, 1.0], [1.0, 0.0]]), jnp.array([[1.0], [2.0]]))[:, :, 0].tolist()
    [[2.0], [1.0]]
    """
    index, valid = neighbors(adjacency)
    inbox = messages[index]
    valid = valid.reshape(valid.shape + (1,) * (messages.ndim - 1))
    return jnp.where(valid, inbox, jnp.zeros((), messages.dtype))


def agent_keys(rng_key, num_agents: int, t):
    """``(N,)`` keys of iteration ``t``: agent ``m``'s is ``fold_in(fold_in(rng_key, m), t)``.

    >>> agent_keys(jax.random.PRNGKey(0), 3, 5).shape
    (3, 2)
    """
    return jax.vmap(lambda m: jax.random.fold_in(jax.random.fold_in(rng_key, m), t))(jnp.arange(num_agents))


def start_network(program: AgentProgram, adjacency, own) -> NetworkState:
    """The network at the agents' own states ``own`` (leading axis ``N``): every agent sends
    ``program.message(own_m)`` to its neighbours."""
    messages = jax.vmap(program.message)(own)
    return NetworkState(own, deliver(adjacency, messages))


def info_struct(program: AgentProgram, adjacency, local, state):
    """The ``ShapeDtypeStruct`` tree of one iteration's ``info`` (leading agent axis ``N``),
    from ``local`` (the agents' stacked locals, arrays or ``ShapeDtypeStruct``s: in
    deployment only their shapes are known on the driver) and a network state (arrays,
    tracers or ``ShapeDtypeStruct``s)."""
    n = np.asarray(adjacency).shape[0]

    def info(local, state):
        keys = agent_keys(jax.random.PRNGKey(0), n, 0)
        return network_iteration(program._replace(local=local, attach=None), adjacency, keys, state)[1]

    return jax.eval_shape(info, local, state)


def attached_struct(program: AgentProgram, block_struct):
    """The ``ShapeDtypeStruct`` tree of the agents' stacked locals in deployment, from the
    stacked shapes of their blocks (what the agents report) and ``program.local``."""
    if program.attach is None:
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), program.local)
    return jax.eval_shape(jax.vmap(program.attach), block_struct, program.local)


def network_iteration(program: AgentProgram, adjacency, keys, state: NetworkState):
    """One iteration of every agent in this process: ``(state, info)``, ``info`` stacked on
    a leading agent axis. ``keys``: ``(N,)`` (see :func:`agent_keys`)."""
    masks = neighbors(adjacency)[1]
    pending, messages = jax.vmap(program.send)(program.local, keys, state.own, state.inbox, masks)
    inbox = deliver(adjacency, messages)
    own, info = jax.vmap(program.receive)(program.local, pending, inbox, state.inbox, masks)
    return NetworkState(own, inbox), info


class InProcessNetwork:
    """``program``'s agents in this process: :func:`network_iteration` (every agent
    ``vmap``-ped), compiled into the caller's ``jit``. What
    :meth:`InProcess.agent_network <numpyro_fed.federation.InProcess.agent_network>` returns.

    >>> import jax, jax.numpy as jnp
    >>> from typing import NamedTuple
    >>> class Own(NamedTuple):
    ...     x: jax.Array
    >>> def send(local, key, own, inbox, mask):  # move to the mean of itself and its neighbours
    ...     x = (own.x + inbox.sum(0)) / (1 + mask.sum())
    ...     return x, x  # (what receive gets, the message)
    >>> program = AgentProgram(lambda own: own.x, send, lambda local, x, inbox, previous, mask: (Own(x), ()),
    ...                        local=jnp.zeros(3))
    >>> network = InProcessNetwork(program, np.ones((3, 3)) - np.eye(3))
    >>> state, info = network.step(jax.random.PRNGKey(0), 0, network.start(Own(jnp.array([[0.0], [3.0], [6.0]]))))
    >>> state.x.ravel().tolist()
    [3.0, 3.0, 3.0]
    """

    #: the agents hold their data here (the driver's ``program.local``)
    deployed = False

    def __init__(self, program: AgentProgram, adjacency, *, name: str = "agents"):
        if program.attach is not None:
            raise ValueError(
                "an agent program with attach= runs on agents that loaded their own rows where they "
                "live; in this process, build it from the clients' blocks"
            )
        self.program = program
        self.adjacency = np.asarray(adjacency) != 0
        self.num_agents = self.adjacency.shape[0]
        self.name = name
        #: unused in this process (a fault of a remote agent is described through it)
        self.describe = None

    def start(self, own) -> NetworkState:
        """The network at the agents' own states (see :func:`start_network`)."""
        return start_network(self.program, self.adjacency, own)

    def step(self, rng_key, i, state: NetworkState):
        """Iteration ``i`` of every agent: ``(state, info)``; agent ``m`` draws from
        ``fold_in(fold_in(rng_key, m), i)`` (:func:`agent_keys`)."""
        return network_iteration(self.program, self.adjacency, agent_keys(rng_key, self.num_agents, i), state)

    def local_struct(self):
        """The ``ShapeDtypeStruct`` tree of the agents' stacked locals."""
        return attached_struct(self.program, None)

    def sampler_step(self, batched: bool):
        """``step(rng_key, i, state, sent) -> (state, info, sent)`` (see the module's
        docstring): :meth:`step`, and ``sent`` counted from the graph and the message's size."""
        degrees = self.adjacency.sum(axis=1).astype(np.int64)

        def one(rng_key, i, state, sent):
            state, info = self.step(rng_key, i, state)
            message_bytes = tree_nbytes(jax.eval_shape(jax.vmap(self.program.message), state.own)) // self.num_agents
            return (
                state,
                info,
                sent._replace(messages=sent.messages + degrees, bytes=sent.bytes + degrees * message_bytes),
            )

        return jax.vmap(one) if batched else one
