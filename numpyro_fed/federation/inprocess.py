"""The default backend: every client in this process, vectorised with ``vmap``."""

from __future__ import annotations

import contextlib
from functools import partial

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.federation.base import (
    ClientError,
    ClientProgram,
    ClientState,
    Federation,
    block_spec,
    check_block,
    tree_nbytes,
)
from numpyro_fed.federation.decentralized import InProcessNetwork
from numpyro_fed.federation.ledger import MessageLedger

__all__ = ["InProcess"]


class _Shared:
    """What the copies of one InProcess that JAX makes when it flattens it share."""

    def __init__(self, program, ledger, specs, faults=None):
        self.program = program
        self.ledger = ledger
        self.specs = specs
        self.sizes = {}  # call name -> (per-client bytes down, per-client bytes up)
        self.counting = True  # False while tracing code whose caller counts its calls
        self.compiled = {}  # (call name, stateful) -> its client function under jax.jit
        self.faults = faults  # simulated faults: (name, clients) -> which of them fail
        self.error = None  # the ClientError a host callback raised (see guard)
        self.absences = {}  # client -> why its last partial call failed

    def count(self, name, calls, _batch, answered=None, sizes=None) -> None:
        """Host side, called by the compiled code at every call it makes (``calls``: ``(M,)``
        messages per client; one call per element of a ``vmap`` whose requests differ;
        ``answered``: ``(M,)``, whether each client's reply came, of a partial call;
        ``sizes``: the call's ``(bytes down, bytes up)`` per client as it was traced, default
        the last traced call of that name's)."""
        down, up = self.sizes[name] if sizes is None else sizes
        calls = np.asarray(calls, dtype=np.int64)
        replied = calls if answered is None else calls * np.asarray(answered, np.int64)
        self.ledger.add(name, "to_client", None, messages=calls, nbytes=calls * down, rounds=replied)
        self.ledger.add(name, "from_client", None, messages=replied, nbytes=replied * up)


def _keep(answered, new, old):
    """``new`` where ``answered`` (leading axis, or a scalar), else ``old`` (a tree like
    ``new``, or a number)."""

    def pick(a, b):
        mask = jnp.reshape(answered, jnp.shape(answered) + (1,) * (jnp.ndim(a) - jnp.ndim(answered)))
        return jnp.where(mask, a, jnp.asarray(b, a.dtype) if not hasattr(b, "shape") else b)

    if not isinstance(old, (int, float)):
        return jax.tree_util.tree_map(pick, new, old)
    return jax.tree_util.tree_map(lambda a: pick(a, old), new)


def _slice_bytes(tree, num_clients):
    return tree_nbytes(tree) // max(num_clients, 1)


@jax.tree_util.register_pytree_node_class
class InProcess(Federation):
    """Every client in this process: :meth:`map` is a ``vmap`` over the clients' stacked
    blocks and :meth:`one` a dynamic index into them, compiled into the caller's ``jit``.

    An ``InProcess`` is a pytree whose leaves are the stacked blocks: pass it as an argument
    of a jitted function (rather than closing over it) so the blocks are not baked into the
    compiled code as constants. Every call counts itself in the ledger when it runs (a host
    callback, ``jax.debug.callback``; under a ``vmap`` whose requests differ, one message per
    element), with the message sizes seen when it was traced: the same counts an engine
    backend makes from the payloads it sends. Code that calls the clients once per event of
    a long compiled loop counts its calls itself instead (:meth:`counted_by_caller`).

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.federation import ClientProgram, InProcess
    >>> program = ClientProgram.stacked({"dot": lambda block, w: block @ w},
    ...                                 jnp.arange(6.0).reshape(3, 2))
    >>> fed = InProcess().start(program)
    >>> step = jax.jit(lambda fed, w: fed.map("dot", w))
    >>> step(fed, jnp.ones(2, jnp.float32)).tolist()  # one reply per client
    [1.0, 5.0, 9.0]
    >>> fed.ledger.summary()["bytes_to_client"].tolist()  # w: 2 float32 per client
    [8, 8, 8]

    **Simulated faults.** In-process clients cannot fail; ``faults`` simulates clients that
    drop out: ``faults(name, clients) -> bool array``, called on the host at every call
    ``name`` with the indices of the clients it reaches (an int array), says which of them
    fail it. A failed call is what an engine's failed call is: a
    :class:`~numpyro_fed.federation.ClientError` naming the client, or with ``partial=True``
    a call that goes on with the others (see :meth:`Federation.map
    <numpyro_fed.federation.Federation.map>`).

    >>> fed = InProcess(faults=lambda name, clients: clients == 1).start(program)
    >>> replies, answered = jax.jit(lambda fed, w: fed.map("dot", w, partial=True))(fed, jnp.ones(2))
    >>> replies.tolist(), answered.tolist(), fed.absences
    ([1.0, 0.0, 9.0], [True, False, True], {1: 'a simulated fault'})
    """

    in_process = True

    def __init__(self, *, loader=None, num_clients=None, faults=None):
        super().__init__(loader=loader, num_clients=num_clients)
        if faults is not None and not callable(faults):
            raise TypeError(f"faults must be a function (name, clients) -> which fail, got {type(faults).__name__}")
        self.faults = faults
        self._shared: _Shared | None = None
        self._blocks = None

    # -- pytree ----------------------------------------------------------------------------
    def tree_flatten(self):
        return (self._blocks,), (self._shared, self.loader, self.loader_num_clients, self.faults)

    @classmethod
    def tree_unflatten(cls, aux, children):
        shared, loader, num_clients, faults = aux
        new = cls.__new__(cls)
        Federation.__init__(new, loader=loader, num_clients=num_clients)
        new.faults = faults
        new._shared = shared
        new._blocks = children[0]
        if shared is not None:
            new._program, new._ledger = shared.program, shared.ledger
        return new

    # -- errors and absences live in what the copies share ------------------------------------
    def keep_error(self, error) -> None:
        if self._shared is not None:
            self._shared.error = error

    def _take_error(self):
        if self._shared is None:
            return None
        error, self._shared.error = self._shared.error, None
        return error

    def _absences(self) -> dict:
        return self._shared.absences

    # -- host side -------------------------------------------------------------------------
    def start(self, program: ClientProgram) -> "InProcess":
        if not isinstance(program, ClientProgram):
            raise TypeError(f"start takes a ClientProgram, not {type(program).__name__}")
        if program.blocks is not None:
            blocks = list(program.blocks)
        else:
            blocks = [program.loader(m) for m in range(program.num_clients)]
        for m, block in enumerate(blocks):
            check_block(block, m, program.spec)
        specs = [block_spec(b) for b in blocks]
        for m, spec in enumerate(specs[1:], 1):
            if spec != specs[0]:
                raise ValueError(
                    f"InProcess stacks the clients' blocks, so they must have equal shapes: "
                    f"client {m} has {spec}, client 0 has {specs[0]} (pad the rows to a common "
                    "length and mask them)"
                )
        # stacked on the host: a jnp.stack would compile one program per leaf shape
        self._blocks = jax.tree_util.tree_map(lambda *a: jnp.asarray(np.stack([np.asarray(x) for x in a])), *blocks)
        self._program = program
        self._ledger = MessageLedger(program.num_clients)
        self._shared = _Shared(program, self._ledger, specs, self.faults)
        return self

    @property
    def blocks(self):
        """The clients' blocks stacked on a leading axis ``M``."""
        return self._blocks

    @property
    def block_specs(self) -> list:
        return list(self._shared.specs)

    @contextlib.contextmanager
    def counted_by_caller(self):
        """Host side: calls traced inside this block do not count themselves; their caller
        counts them in its own state (a sampler whose compiled loop calls the clients at every
        event, where a host callback per call would cost more than the call) and reports
        them as part of its run's ledger, or with the ``count(name, calls)`` this yields (see
        :meth:`Federation.counted_by_caller <numpyro_fed.federation.Federation.counted_by_caller>`).
        Engine backends count every payload they send."""
        previous, self._shared.counting = self._shared.counting, False

        def count(name, calls):
            self._shared.count(name, np.broadcast_to(np.asarray(calls, np.int64), (self.num_clients,)), None)

        try:
            yield count
        finally:
            self._shared.counting = previous

    def _counted(self, name, down, up, calls, like, answered=None) -> None:
        """Records ``name``'s message sizes and, unless the caller counts, makes the compiled
        code count ``calls`` (``(M,)``) when it runs; ``like``: the request, whose batching
        under a ``vmap`` the count follows; ``answered``: ``(M,)``, the clients whose reply
        came (a partial call)."""
        self._shared.sizes[name] = (int(down), int(up))
        if not self._shared.counting:
            return
        leaves = [
            x
            for x in jax.tree_util.tree_leaves(like)
            if hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        ]
        batch = jnp.ravel(jnp.asarray(leaves[0]))[:1] if leaves else jnp.zeros(1, jnp.int32)
        # this call's own sizes: one call name may carry requests of different shapes (one
        # point and a batch of them)
        count = partial(self._shared.count, name, sizes=(int(down), int(up)))
        jax.debug.callback(count, calls, batch, answered)

    def _answered(self, name, clients, partial):
        """``(C,)`` bool: which of ``clients`` (``(C,)`` ints) answer call ``name``: all
        (``None``) unless ``faults`` simulates some failing. A failure of a call that is not
        ``partial`` raises a :class:`ClientError` naming the client (kept for :meth:`guard`)."""
        if self.faults is None:
            return None

        def host(clients):
            shape, clients = np.shape(clients), np.asarray(clients).reshape(-1)
            failing = np.asarray(self.faults(name, clients), bool).reshape(clients.shape)
            failed = [int(c) for c in clients[failing]]
            if failed and not partial:
                error = ClientError(f"call '{name}': client(s) {failed} failed (a simulated fault)", clients=failed)
                error.call = name
                self.keep_error(error)
                raise error
            self._note_answers(name, clients, set(clients[~failing].tolist()), lambda m: "a simulated fault")
            return (~failing).reshape(shape)

        clients = jnp.asarray(clients, jnp.int32)
        struct = jax.ShapeDtypeStruct(clients.shape, jnp.bool_)
        return jax.pure_callback(host, struct, clients, vmap_method="sequential")

    def init_state(self, initial) -> ClientState:
        """Every client's initial state, stacked (leading axis ``M``), kept in the returned
        :class:`~numpyro_fed.federation.ClientState`'s ``values`` (the clients live in this
        process); counted as call ``"init_state"`` as a remote backend sends it."""
        initial = self._check_initial_state(initial)
        self._record_init_state(initial)
        return ClientState(initial, jnp.zeros(self.num_clients, jnp.int32))

    # -- traceable side --------------------------------------------------------------------
    def _call(self, name, broadcast, stateful):
        """``(block, state_c, own_c) -> (new_state_c, reply)`` for call ``name``: a stateless
        call keeps an empty state."""
        fn = self._compiled(name, stateful)
        if stateful:
            return lambda block, mine, own: fn(block, mine, *broadcast, *own)
        return lambda block, mine, own: (mine, fn(block, *broadcast, *own))

    def _compiled(self, name, stateful):
        """Call ``name``'s client function under one ``jax.jit`` kept for the federation's
        life: every program that calls it reuses its trace (a client's term traces the model;
        a sampler's set-up calls it from several compiled programs)."""
        key = (name, stateful)
        if key not in self._shared.compiled:
            fn = self._stateful_function(name) if stateful else self._function(name)
            self._shared.compiled[key] = jax.jit(fn)
        return self._shared.compiled[key]

    def map(self, name, *broadcast, per_client=(), state=None, partial=False):
        call, per_client = self._call(name, broadcast, state is not None), tuple(per_client)
        old = () if state is None else state.values
        values, replies = jax.vmap(call)(self._blocks, old, per_client)
        m = self.num_clients
        answered = self._answered(name, jnp.arange(m), partial)
        if answered is not None:  # a client that failed: no reply, its state unchanged
            replies, values = _keep(answered, replies, 0), _keep(answered, values, old)
        down, up = tree_nbytes(broadcast) + _slice_bytes(per_client, m), _slice_bytes(replies, m)
        self._counted(name, down, up, np.ones(m, np.int32), (broadcast, per_client), answered)
        answered = jnp.ones(m, bool) if answered is None else answered
        extra = (answered,) if partial else ()
        if state is None:
            return (replies,) + extra if partial else replies
        return (ClientState(values, state.version + answered.astype(jnp.int32)), replies) + extra

    def one(self, name, client, *broadcast, own=(), state=None, partial=False):
        call, own = self._call(name, broadcast, state is not None), tuple(own)
        values = () if state is None else state.values
        client = jnp.asarray(client)
        if client.ndim == 0:
            take = lambda a: lax.dynamic_index_in_dim(a, client, 0, keepdims=False)  # noqa: E731
            block, mine, own_c = jax.tree_util.tree_map(take, (self._blocks, values, own))
            new, reply = call(block, mine, own_c)
            reply_bytes = tree_nbytes(reply)
        elif client.ndim == 1 and state is not None:  # distinct clients (a stateful call only)
            take = lambda a: a[client]  # noqa: E731
            block, mine, own_c = jax.tree_util.tree_map(take, (self._blocks, values, own))
            new, reply = jax.vmap(call)(block, mine, own_c)
            own_c = jax.tree_util.tree_map(lambda a: a[0], own_c)
            reply_bytes = _slice_bytes(reply, client.shape[0])
        else:
            allowed = "an index or a 1-d array of them" if state is not None else "an index (without state)"
            raise ValueError(f"call '{name}': client must be {allowed}, got shape {client.shape}")
        answered = self._answered(name, client, partial)
        if answered is not None:  # a client that failed: no reply, its state unchanged
            reply, new = _keep(answered, reply, 0), _keep(answered, new, mine)
        calls = jnp.zeros(self.num_clients, jnp.int32).at[client].add(1)
        replied = None if answered is None else jnp.zeros(self.num_clients, bool).at[client].set(answered)
        self._counted(
            name, tree_nbytes(broadcast) + tree_nbytes(own_c), reply_bytes, calls, (broadcast, own_c), replied
        )
        answered = jnp.ones(client.shape, bool) if answered is None else answered
        extra = (answered,) if partial else ()
        if state is None:
            return (reply,) + extra if partial else reply
        values = jax.tree_util.tree_map(lambda a, n: a.at[client].set(n), values, new)
        return (ClientState(values, state.version.at[client].add(answered.astype(jnp.int32))), reply) + extra

    # -- decentralized agents ----------------------------------------------------------------
    runs_agents = True

    def agent_network(self, program, adjacency, *, name="agents", settings=None, previous=None):
        """The agents in this process: an
        :class:`~numpyro_fed.federation.decentralized.InProcessNetwork` (``program.local``
        holds their data; nothing to start, so ``settings`` and ``previous`` do not matter)."""
        return InProcessNetwork(program, adjacency, name=name)

    def agent_hosts(self, loader, adjacency, *, name="agents", previous=None):
        raise TypeError(
            "InProcess loads the clients' blocks in this process (start(program) runs the loader): "
            "build the agents' program from its blocks and run it with agent_network"
        )

    def __repr__(self) -> str:
        state = "not started" if self._shared is None else f"num_clients={self.num_clients}"
        return f"InProcess({state}{self._loader_repr()})"
