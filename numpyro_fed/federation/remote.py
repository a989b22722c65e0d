"""The server's side of every engine backend: :class:`RemoteFederation`.

An engine backend (:class:`~numpyro_fed.federation.RayFederation`,
:class:`~numpyro_fed.flower.FlowerFederation`) runs each client somewhere else; what differs
between engines is only how a request reaches a client and its reply comes back. This class
owns everything else, once: the traceable :meth:`~RemoteFederation.map` and
:meth:`~RemoteFederation.one` (plain and with a :class:`~numpyro_fed.federation.ClientState`)
as ``jax.pure_callback``\\ s (``vmap_method="expand_dims"``: under a ``vmap`` over chains a
single round trip carries every chain's request, and each client ``vmap``\\ s its function
over the chains it received), the shapes of the replies (the same for every client, checked
on every client's block spec), the checks of client indices and client states, the stacking
of the replies and the message ledger (the payloads really sent and received).

A new engine implements four transport hooks (and the host side of
:class:`~numpyro_fed.federation.Federation`: ``describe``, ``close``, ``restart`` as it can):

* :meth:`~RemoteFederation.start_clients` ``(program) -> specs``: give every client its
  program and rows; return, per client, the ``ShapeDtypeStruct`` tree of its block;
* :meth:`~RemoteFederation.send_calls` ``(name, calls) -> {client: reply}``: run
  ``program.functions[name]`` on the clients named in ``calls`` (a :class:`Call` each);
* :meth:`~RemoteFederation.send_stateful_calls` ``(name, calls) -> {client: (reply,
  version)}``: run ``program.stateful[name]`` on the client's state of version
  ``call.version``, keep the new state as version ``call.version + 1``;
* :meth:`~RemoteFederation.send_initial_state` ``(slices)``: version 0 of every client's state.

A hook raises :class:`~numpyro_fed.federation.ClientError` naming the clients that failed or
did not answer.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.federation.base import ClientError, ClientProgram, ClientState, Federation, tree_nbytes
from numpyro_fed.federation.ledger import MessageLedger

__all__ = ["Call", "RemoteFederation"]


class Call(NamedTuple):
    """One client's request, as a transport hook receives it (host side, NumPy arrays).

    :ivar tuple args: the arguments after the client's block (and after its state, for a
        stateful call): pytrees of NumPy arrays.
    :ivar in_axes: ``None``: call the function once; else a tree like ``args`` with ``0`` or
        ``None`` at each leaf: ``vmap`` the function over the leading (chain) axis of the
        leaves marked ``0`` (``jax.vmap(f, in_axes=(None,) + in_axes)``, the block unbatched).
    :ivar int nbytes: the bytes of ``args``' leaves: what the ledger counts as sent.
    :ivar version: a stateful call: the version of the client's state it starts from (else
        ``None``).
    """

    args: tuple
    in_axes: Any
    nbytes: int
    version: int | None = None


def _unbatch(leaves, ndims):
    """Host side of a ``vmap_method="expand_dims"`` callback: the batch shape, and every leaf
    as ``(B, ...)`` (in_axis 0) or without batch axes (in_axis ``None``)."""
    extra = {leaf.ndim - nd for leaf, nd in zip(leaves, ndims)}
    if len(extra) != 1:
        raise RuntimeError(f"inconsistent batch dimensions in a federation callback: {extra}")
    nb = extra.pop()
    if nb == 0:
        return (), list(leaves), [None] * len(leaves)
    batch_shape = np.broadcast_shapes(*[leaf.shape[:nb] for leaf in leaves])
    size = int(np.prod(batch_shape))
    out, axes = [], []
    for leaf in leaves:
        lead = leaf.shape[:nb]
        rest = leaf.shape[nb:]
        if all(d == 1 for d in lead):
            out.append(leaf.reshape(rest))
            axes.append(None)
        else:
            out.append(np.broadcast_to(leaf, tuple(batch_shape) + rest).reshape((size,) + rest))
            axes.append(0)
    return tuple(batch_shape), out, axes


def _packable(dtype) -> bool:  # jnp.issubdtype: an extended dtype (a typed PRNG key) is none of these
    return any(jnp.issubdtype(dtype, kind) for kind in (jnp.bool_, jnp.integer, jnp.floating))


def _pack(arrays):
    """Traced side: ``arrays`` as one ``uint8`` vector and its layout (per array, in the
    vector's order: its index, shape and dtype), or ``None`` if one of them has a dtype that
    is not a boolean, integer or floating one (e.g. a typed PRNG key). A host callback turns
    each of its arguments into a device array before it runs (about 70 us each on this
    project's 2-core machine): one vector costs one. The widest dtypes come first, so that
    every array starts at a multiple of its item size."""
    arrays = [jnp.asarray(a) for a in arrays]
    if not all(_packable(a.dtype) for a in arrays):
        return None
    dtypes = [np.dtype(a.dtype) for a in arrays]
    order = sorted(range(len(arrays)), key=lambda i: -dtypes[i].itemsize)
    parts = []
    for i in order:
        a = arrays[i].astype(jnp.uint8) if dtypes[i] == np.bool_ else arrays[i]
        parts.append(jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1))
    buffer = jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.uint8)
    return buffer, tuple((i, tuple(arrays[i].shape), dtypes[i]) for i in order)


def _unpack(buffer, layout) -> list:
    """Host side of :func:`_pack`: the arrays, as views of ``buffer`` in their first order."""
    out, start = [None] * len(layout), 0
    for i, shape, dtype in layout:
        stop = start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[i] = buffer[start:stop].view(dtype).reshape(shape)
        start = stop
    return out


def _struct(a):
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))


def _row_struct(a):  # one client's row of an array with a leading client axis
    return jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a))


class RemoteFederation(Federation):
    """A :class:`~numpyro_fed.federation.Federation` whose clients live elsewhere, reached
    through four transport hooks (see :mod:`numpyro_fed.federation.remote`). A subclass
    registers itself as a pytree with no leaves
    (``@jax.tree_util.register_pytree_node_class``), so that it can be passed to ``jit``.

    The client states stay with the clients: a :class:`~numpyro_fed.federation.ClientState`
    of a remote federation holds the versions only (its ``values`` are ``()``), and a
    stateful call sends each client the version it starts from.

    A tiny engine whose clients are in this process (for tests and as a template):

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.federation import ClientProgram
    >>> from numpyro_fed.federation.base import block_spec
    >>> from numpyro_fed.federation.remote import RemoteFederation
    >>> @jax.tree_util.register_pytree_node_class
    ... class Local(RemoteFederation):
    ...     def start_clients(self, program):
    ...         return [block_spec(block) for block in program.blocks]
    ...     def send_calls(self, name, calls):
    ...         fn = self.program.functions[name]
    ...         batched = lambda c: fn if c.in_axes is None else jax.vmap(fn, (None,) + tuple(c.in_axes))
    ...         return {m: batched(c)(self.program.blocks[m], *c.args) for m, c in calls.items()}
    >>> fed = Local().start(ClientProgram.stacked({"dot": lambda block, w: block @ w},
    ...                                           jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2)))
    >>> jax.jit(lambda w: fed.map("dot", w))(jnp.ones(2, jnp.float32)).tolist()
    [1.0, 5.0, 9.0]
    >>> fed.ledger.summary()["dot/bytes_to_client"].tolist()  # w (two float32), to each client
    [8, 8, 8]
    >>> jax.vmap(lambda w: fed.map("dot", w))(jnp.ones((4, 2), jnp.float32)).shape  # 4 chains, 1 round trip
    (4, 3)
    >>> fed.ledger.round_trips
    2
    """

    def __init__(self, *, loader=None, num_clients: int | None = None):
        super().__init__(loader=loader, num_clients=num_clients)
        self._specs = None  # per client, the ShapeDtypeStruct tree of its block
        self._reply_cache = {}  # (call, argument shapes) -> the reply's ShapeDtypeStructs
        self._error = None  # the ClientError a host callback raised (see guard)
        self._state_struct = None  # one client's state: ShapeDtypeStructs (set by init_state)

    # -- transport hooks -----------------------------------------------------------------------
    @abc.abstractmethod
    def start_clients(self, program: ClientProgram) -> list:
        """Gives every client ``program`` and its rows (its block of ``program.blocks``, or
        its ``program.loader``); returns, per client, the ``ShapeDtypeStruct`` tree of its
        block (shapes and dtypes, never values). Refuses bad blocks with a ``ValueError``
        naming the client. Called by :meth:`start`."""

    @abc.abstractmethod
    def send_calls(self, name: str, calls: dict) -> dict:
        """``{client: Call}`` -> ``{client: reply}``: client ``m`` runs
        ``program.functions[name](block, *args)`` (``vmap``-ed over ``calls[m].in_axes`` when
        not ``None``) and its reply comes back: a pytree of arrays, or the list of its leaves.
        Raises :class:`~numpyro_fed.federation.ClientError` naming the clients that failed."""

    def send_stateful_calls(self, name: str, calls: dict) -> dict:
        """``{client: Call}`` -> ``{client: (reply, new_version)}``: client ``m`` runs
        ``program.stateful[name](block, state, *args) -> (new_state, reply)`` on its state of
        version ``calls[m].version``, keeps ``new_state`` as version ``version + 1`` (and the
        state it started from, so that the same call again gives the same reply) and sends
        back the reply only. Never batched (``in_axes`` is ``None``). Raises
        :class:`~numpyro_fed.federation.ClientError` naming the clients that failed, e.g. one
        that holds no state of that version."""
        raise NotImplementedError(f"{type(self).__name__} keeps no client state")

    def send_initial_state(self, slices: dict) -> None:
        """``{client: its initial state}`` (NumPy arrays): version 0 of every client's state.
        Raises :class:`~numpyro_fed.federation.ClientError` naming the clients that failed."""
        raise NotImplementedError(f"{type(self).__name__} keeps no client state")

    # -- pytree: no leaves (the blocks live with the clients), so it can be passed to jit ------
    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, federation, children):
        return federation

    # -- host side -----------------------------------------------------------------------------
    def start(self, program: ClientProgram) -> "RemoteFederation":
        """Gives each client its program and block (or runs its loader where it lives), with
        :meth:`start_clients`; returns ``self``."""
        if not isinstance(program, ClientProgram):
            raise TypeError(f"start takes a ClientProgram, not {type(program).__name__}")
        self._program, self._specs, self._reply_cache = None, None, {}
        self._ledger = MessageLedger(program.num_clients)
        self._specs = list(self.start_clients(program))
        self._program = program
        return self

    def call_timeout(self, name: str, timeout: float) -> float:
        """The seconds a call of ``name`` may take: the program's ``timeouts[name]`` if it
        gives one (a call that is a client's whole run), else ``timeout`` (the engine's)."""
        program = self._program
        return float(program.timeouts.get(name, timeout)) if program is not None else float(timeout)

    @property
    def block_specs(self) -> list:
        if self._specs is None:
            raise RuntimeError(f"{type(self).__name__} has not been started: call start(program)")
        return list(self._specs)

    def init_state(self, initial) -> ClientState:
        """Sends client ``m`` its slice of ``initial`` (leading axis ``M``) as version 0 of its
        client state, once (:meth:`send_initial_state`); the returned
        :class:`~numpyro_fed.federation.ClientState` holds the versions only (its ``values``
        are ``()``: the states live with the clients)."""
        initial = jax.tree_util.tree_map(np.asarray, self._check_initial_state(initial))
        self._transport(
            self.send_initial_state,
            {m: jax.tree_util.tree_map(lambda a, m=m: a[m], initial) for m in range(self.num_clients)},
        )
        self._record_init_state(initial)
        self.ledger.round_trips += 1
        self._state_struct = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), initial)
        return ClientState((), jnp.zeros(self.num_clients, jnp.int32))

    def _transport(self, hook, *args):
        """A hook's answer; a :class:`ClientError` it raises is kept for :meth:`guard` (JAX
        wraps what a host callback raises)."""
        try:
            return hook(*args)
        except ClientError as error:
            self._error = error
            raise

    def rejoin(self, clients) -> set:
        """Host side, before a ``partial`` call: of ``clients`` (those whose last call
        failed), the ones to send it to (default: all; an engine first replaces the workers
        that died, e.g. :meth:`RayFederation.rejoin <numpyro_fed.federation.RayFederation.rejoin>`)."""
        return set(clients)

    def _exchange(self, hook, name, calls, partial):
        """``hook(name, calls)``'s replies, ``{client: reply}``. Without ``partial`` a
        :class:`ClientError` stops the call (kept for :meth:`guard`); with it the clients that
        answered are returned (the others are noted in :attr:`absences` and the ledger, and
        those the call was not sent to, whose worker could not be replaced, leave ``calls``:
        the ledger counts no request of theirs)."""
        if not partial:
            return self._transport(hook, name, calls)
        absent = set(self._absences()) & set(calls)
        ready = self.rejoin(sorted(absent)) if absent else set()
        sent = {m: c for m, c in calls.items() if m not in absent or m in ready}
        reasons = {m: "its worker could not be replaced" for m in calls if m not in sent}
        try:
            replies = hook(name, sent) if sent else {}
        except ClientError as error:
            self._take_error()
            replies = {m: r for m, r in error.replies.items() if m in sent}
            reasons.update({m: str(error) for m in sent if m not in replies})
        self._note_answers(name, calls, set(replies), lambda m: reasons.get(m, "failed"))
        for m in set(calls) - set(sent):
            del calls[m]
        return replies

    def _fail(self, error):
        self._error = error
        raise error

    def _count(self, name, calls, replies, messages):
        """Counts a round of ``calls`` in the ledger: one update per direction, every client's
        entry at once (a round is counted on the way of every call)."""
        clients = np.fromiter(calls, dtype=np.int64, count=len(calls))
        if isinstance(messages, dict):
            n = np.array([messages[m] for m in clients], dtype=np.int64)
        else:
            n = np.full(clients.shape, messages, dtype=np.int64)
        answered = np.array([m in replies for m in clients], dtype=bool)  # a failed call: no reply
        sent = np.array([calls[m].nbytes for m in clients], dtype=np.int64)
        self.ledger.add(name, "to_client", clients, messages=n, nbytes=sent, rounds=np.where(answered, n, 0))
        if answered.any():
            got = clients[answered]
            received = np.array([tree_nbytes(replies[m]) for m in got], dtype=np.int64)
            self.ledger.add(name, "from_client", got, messages=n[answered], nbytes=received)
        self.ledger.round_trips += 1

    @staticmethod
    def _reply_leaves(replies, m, reply_leaves):
        """Client ``m``'s reply as a list of leaves; zeros for a client that did not answer."""
        if m in replies:
            return jax.tree_util.tree_leaves(replies[m])
        return [np.zeros(s.shape, s.dtype) for s in reply_leaves]

    # -- reply shapes ------------------------------------------------------------------------
    def _check_same_replies(self, name, shapes):
        for m, s in enumerate(shapes[1:], 1):
            if s != shapes[0]:
                raise ValueError(
                    f"call '{name}': client {m}'s reply has shape {s}, client 0's "
                    f"{shapes[0]}; replies must not depend on the number of rows"
                )
        return shapes[0]

    def _reply_struct(self, name, arg_structs):
        """The shape of one client's reply, the same for every client (checked on each
        client's block spec)."""
        key = (name, tuple(jax.tree_util.tree_leaves(arg_structs)), jax.tree_util.tree_structure(arg_structs))
        if key not in self._reply_cache:
            fn = self._function(name)
            self._reply_cache[key] = self._check_same_replies(
                name, [jax.eval_shape(fn, spec, *arg_structs) for spec in self.block_specs]
            )
        return self._reply_cache[key]

    def _stateful_reply_struct(self, name, arg_structs):
        if self._state_struct is None:
            raise RuntimeError(f"call '{name}' with a client state: call init_state(initial) on this federation first")
        key = (
            "stateful",
            name,
            tuple(jax.tree_util.tree_leaves(arg_structs)),
            jax.tree_util.tree_structure(arg_structs),
        )
        if key not in self._reply_cache:
            fn = self._stateful_function(name)
            shapes = [jax.eval_shape(fn, spec, self._state_struct, *arg_structs) for spec in self.block_specs]
            for new_state, _ in shapes:
                if new_state != self._state_struct:
                    raise ValueError(
                        f"stateful function '{name}' returns a state of structure {new_state}, "
                        f"the clients' state has {self._state_struct}"
                    )
            self._reply_cache[key] = self._check_same_replies(name, [reply for _, reply in shapes])
        return self._reply_cache[key]

    def _reply(self, name, broadcast, own, stateful):
        """The shape of one client's reply to ``name`` with these arguments (``own``: arrays
        with a leading client axis)."""
        arg_structs = tuple(jax.tree_util.tree_map(_struct, broadcast)) + tuple(
            jax.tree_util.tree_map(_row_struct, own)
        )
        return (self._stateful_reply_struct if stateful else self._reply_struct)(name, arg_structs)

    def _check_remote_state(self, name, state):
        if not isinstance(state, ClientState):
            raise TypeError(f"call '{name}': state must be a ClientState (from init_state), got {type(state).__name__}")
        if jax.tree_util.tree_leaves(state.values):
            raise ValueError(
                f"call '{name}': this ClientState holds its values in this process (an "
                f"InProcess federation's); on a {type(self).__name__} the clients hold them: "
                "create it with this federation's init_state"
            )

    def _unbatched(self, name, host_leaves, ndims):
        batch, flat, _ = _unbatch([np.asarray(x) for x in host_leaves], ndims)
        if batch:
            self._fail(
                ValueError(
                    f"call '{name}' with a client state cannot be batched (vmap) over chains on "
                    f"{type(self).__name__}: each client holds one state"
                )
            )
        return flat

    def _stateful_callback(self, name, host, out_struct, arrays):
        """``jax.pure_callback(host, out_struct, *arrays)`` for a stateful call: ``host`` gets
        ``arrays`` as NumPy arrays without batch axes (a stateful call is never batched: under
        a ``vmap`` it raises). They cross into the callback as one buffer (:func:`_pack`)."""
        packed = _pack(arrays)
        if packed is None:  # each array on its own
            ndims = [jnp.ndim(a) for a in arrays]

            def arrive(host_arrays):
                return self._unbatched(name, host_arrays, ndims)
        else:
            buffer, layout = packed
            arrays = [buffer]

            def arrive(host_arrays):
                return _unpack(self._unbatched(name, host_arrays, [1])[0], layout)

        return jax.pure_callback(
            lambda *host_arrays: host(*arrive(host_arrays)), out_struct, *arrays, vmap_method="expand_dims"
        )

    # -- traceable side ------------------------------------------------------------------------
    def map(self, name, *broadcast, per_client=(), state=None, partial=False):
        per_client = tuple(per_client)
        if state is not None:
            self._check_remote_state(name, state)
        m_clients = self.num_clients
        for leaf in jax.tree_util.tree_leaves(per_client):
            if jnp.shape(leaf)[:1] != (m_clients,):
                raise ValueError(
                    f"call '{name}': per_client arrays need a leading axis of {m_clients} "
                    f"clients, got shape {jnp.shape(leaf)}"
                )
        reply = self._reply(name, broadcast, per_client, state is not None)
        out_struct = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct((m_clients,) + tuple(s.shape), s.dtype), reply
        )
        leaves, treedef = jax.tree_util.tree_flatten((broadcast, per_client))
        ndims = [jnp.ndim(x) for x in leaves]
        num_broadcast = len(jax.tree_util.tree_leaves(broadcast))
        if state is not None:
            return self._map_stateful(name, state, reply, out_struct, leaves, treedef, num_broadcast, partial)
        reply_leaves, reply_def = jax.tree_util.tree_flatten(reply)

        def host(*host_leaves):
            batch, flat, axes = _unbatch([np.asarray(x) for x in host_leaves], ndims)
            if batch and partial:
                self._fail(ValueError(f"call '{name}' with partial=True cannot be batched (vmap) over chains"))
            calls = {}
            for m in range(m_clients):
                args, args_axes = [], []
                for i, (leaf, axis) in enumerate(zip(flat, axes)):
                    if i >= num_broadcast:
                        leaf = leaf[:, m] if axis == 0 else leaf[m]
                    args.append(leaf)
                    args_axes.append(axis)
                b, p = jax.tree_util.tree_unflatten(treedef, args)
                bx, px = jax.tree_util.tree_unflatten(treedef, args_axes)
                in_axes = None if all(a is None for a in args_axes) else tuple(bx) + tuple(px)
                calls[m] = Call(tuple(b) + tuple(p), in_axes, sum(a.nbytes for a in args))
            replies = self._exchange(self.send_calls, name, calls, partial)
            parts = {m: self._reply_leaves(replies, m, reply_leaves) for m in range(m_clients)}
            size = int(np.prod(batch)) if batch else 1
            out = []
            for j, want in enumerate(reply_leaves):
                per = []
                for m in range(m_clients):
                    value = np.asarray(parts[m][j], dtype=want.dtype)
                    if batch and value.ndim == want.ndim:  # no batched argument: one reply for all
                        value = np.broadcast_to(value, (size,) + value.shape)
                    per.append(value)
                out.append(
                    np.stack(per, axis=1 if batch else 0).reshape(tuple(batch) + (m_clients,) + tuple(want.shape))
                )
            self._count(name, calls, replies, size)
            out = jax.tree_util.tree_unflatten(reply_def, out)
            return (out, np.isin(np.arange(m_clients), list(replies))) if partial else out

        if partial:
            out_struct = (out_struct, jax.ShapeDtypeStruct((m_clients,), jnp.bool_))
        return jax.pure_callback(host, out_struct, *leaves, vmap_method="expand_dims")

    def _map_stateful(self, name, state, reply, replies_struct, leaves, treedef, num_broadcast, partial):
        m_clients = self.num_clients
        out_struct = (jax.ShapeDtypeStruct((m_clients,), jnp.int32), replies_struct)
        reply_leaves, reply_def = jax.tree_util.tree_flatten(reply)

        def host(version, *flat):
            version = np.array(version, np.int32)
            calls = {}
            for m in range(m_clients):
                args = [leaf[m] if i >= num_broadcast else leaf for i, leaf in enumerate(flat)]
                b, p = jax.tree_util.tree_unflatten(treedef, args)
                calls[m] = Call(tuple(b) + tuple(p), None, sum(a.nbytes for a in args), int(version[m]))
            answers = self._exchange(self.send_stateful_calls, name, calls, partial)
            replies = {m: answer[0] for m, answer in answers.items()}
            parts = {m: self._reply_leaves(replies, m, reply_leaves) for m in range(m_clients)}
            out = [
                np.stack([np.asarray(parts[m][j], dtype=want.dtype) for m in range(m_clients)]).reshape(
                    (m_clients,) + tuple(want.shape)
                )
                for j, want in enumerate(reply_leaves)
            ]
            self._count(name, calls, replies, 1)
            for m, answer in answers.items():
                version[m] = answer[1]
            out = (version, jax.tree_util.tree_unflatten(reply_def, out))
            return out + (np.isin(np.arange(m_clients), list(answers)),) if partial else out

        if partial:
            out_struct = out_struct + (jax.ShapeDtypeStruct((m_clients,), jnp.bool_),)
        out = self._stateful_callback(name, host, out_struct, [jnp.asarray(state.version, jnp.int32), *leaves])
        return (ClientState((), out[0]),) + tuple(out[1:])

    def one(self, name, client, *broadcast, own=(), state=None, partial=False):
        own = tuple(own)
        if state is not None:
            self._check_remote_state(name, state)
        reply = self._reply(name, broadcast, own, state is not None)
        client = jnp.asarray(client, dtype=jnp.int32)
        if state is not None:
            return self._one_stateful(name, client, state, reply, broadcast, own, partial)
        m_clients = self.num_clients
        leaves, treedef = jax.tree_util.tree_flatten((client, broadcast, own))
        ndims = [jnp.ndim(x) for x in leaves]
        num_broadcast = len(jax.tree_util.tree_leaves(broadcast))
        reply_leaves, reply_def = jax.tree_util.tree_flatten(reply)

        def host(*host_leaves):
            batch, flat, axes = _unbatch([np.asarray(x) for x in host_leaves], ndims)
            if batch and partial:
                self._fail(ValueError(f"call '{name}' with partial=True cannot be batched (vmap) over chains"))
            size = int(np.prod(batch)) if batch else 1
            chosen = np.broadcast_to(flat[0], (size,)) if batch else np.asarray(flat[0]).reshape(1)
            calls, members = {}, {}
            for c in np.unique(chosen):
                c = int(c)
                if not 0 <= c < m_clients:
                    self._fail(
                        ClientError(f"call '{name}': no client {c} (there are {m_clients})", clients=[c], call=name)
                    )
                idx = np.flatnonzero(chosen == c)
                members[c] = idx
                args, args_axes = [], []
                for i, (leaf, axis) in enumerate(zip(flat[1:], axes[1:])):
                    if axis == 0:
                        leaf = leaf[idx]
                    if i >= num_broadcast:
                        leaf = leaf[:, c] if axis == 0 else leaf[c]
                    args.append(leaf)
                    args_axes.append(axis)
                _, b, o = jax.tree_util.tree_unflatten(treedef, [None] + args)
                _, bx, ox = jax.tree_util.tree_unflatten(treedef, [None] + args_axes)
                in_axes = None if all(a is None for a in args_axes) else tuple(bx) + tuple(ox)
                calls[c] = Call(tuple(b) + tuple(o), in_axes, sum(a.nbytes for a in args))
            replies = self._exchange(self.send_calls, name, calls, partial)
            parts = {c: self._reply_leaves(replies, c, reply_leaves) for c in members}
            out = []
            for j, want in enumerate(reply_leaves):
                if not batch:
                    out.append(np.asarray(parts[int(chosen[0])][j], dtype=want.dtype).reshape(want.shape))
                    continue
                full = np.empty((size,) + tuple(want.shape), want.dtype)
                for c, idx in members.items():
                    value = np.asarray(parts[c][j], dtype=want.dtype)
                    full[idx] = value if value.ndim > want.ndim else value[None]
                out.append(full.reshape(tuple(batch) + tuple(want.shape)))
            self._count(name, calls, replies, {c: len(members[c]) for c in calls})
            out = jax.tree_util.tree_unflatten(reply_def, out)
            return (out, np.asarray(int(chosen[0]) in replies)) if partial else out

        out_struct = (reply, jax.ShapeDtypeStruct((), jnp.bool_)) if partial else reply
        return jax.pure_callback(host, out_struct, *leaves, vmap_method="expand_dims")

    def _one_stateful(self, name, client, state, reply, broadcast, own, partial=False):
        m_clients = self.num_clients
        if client.ndim > 1:
            raise ValueError(f"call '{name}': client must be an index or a 1-d array of them, got shape {client.shape}")
        lead = tuple(client.shape)
        out_struct = (
            jax.ShapeDtypeStruct((m_clients,), jnp.int32),
            jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(lead + tuple(s.shape), s.dtype), reply),
        )
        if partial:
            out_struct = out_struct + (jax.ShapeDtypeStruct(lead, jnp.bool_),)
        leaves, treedef = jax.tree_util.tree_flatten((broadcast, own))
        num_broadcast = len(jax.tree_util.tree_leaves(broadcast))
        reply_leaves, reply_def = jax.tree_util.tree_flatten(reply)

        def host(chosen, version, *flat):
            chosen, version = np.asarray(chosen).reshape(-1), np.array(version, np.int32)
            bad = [int(c) for c in chosen if not 0 <= c < m_clients]
            if bad or len(set(chosen.tolist())) != chosen.size:
                self._fail(
                    ClientError(
                        f"call '{name}': clients {chosen.tolist()} must be distinct clients among 0..{m_clients - 1}",
                        clients=bad,
                        call=name,
                    )
                )
            calls = {}
            for c in chosen.tolist():
                args = [leaf[c] if i >= num_broadcast else leaf for i, leaf in enumerate(flat)]
                b, o = jax.tree_util.tree_unflatten(treedef, args)
                calls[c] = Call(tuple(b) + tuple(o), None, sum(a.nbytes for a in args), int(version[c]))
            answers = self._exchange(self.send_stateful_calls, name, calls, partial)
            replies = {c: answer[0] for c, answer in answers.items()}
            parts = {c: self._reply_leaves(replies, c, reply_leaves) for c in chosen.tolist()}
            out = [
                np.stack([np.asarray(parts[c][j], dtype=want.dtype) for c in chosen.tolist()]).reshape(
                    lead + tuple(want.shape)
                )
                for j, want in enumerate(reply_leaves)
            ]
            for c, answer in answers.items():
                version[c] = answer[1]
            self._count(name, calls, replies, 1)
            out = (version, jax.tree_util.tree_unflatten(reply_def, out))
            answered = np.asarray([c in answers for c in chosen.tolist()]).reshape(lead)
            return out + (answered,) if partial else out

        out = self._stateful_callback(name, host, out_struct, [client, jnp.asarray(state.version, jnp.int32), *leaves])
        return (ClientState((), out[0]),) + tuple(out[1:])
