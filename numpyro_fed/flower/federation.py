"""The server's side of Flower: :class:`FlowerFederation`, a
:class:`~numpyro_fed.federation.Federation` whose clients are Flower SuperNodes, used inside
a ``ServerApp``.

:meth:`~FlowerFederation.map` and :meth:`~FlowerFederation.one` are ``jax.pure_callback``\\ s
(as on Ray): each sends the clients' requests as Flower Messages through the ``Grid``
(``grid.send_and_receive`` with a timeout) and waits for their replies, so an algorithm's
core runs unchanged. The ledger counts the arrays of the messages really sent and received.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.federation.base import ClientError, ClientProgram, ClientState, Federation
from numpyro_fed.federation.ledger import MessageLedger
from numpyro_fed.federation.ray_backend import _unbatch
from numpyro_fed.flower._wire import decode_description, decode_tree, encode_tree

__all__ = ["FlowerFederation", "NODE_LOADER"]

#: message types (Flower's ``query`` category; the action names the request)
DESCRIBE, START, CALL = "query.numpyro_fed_describe", "query.numpyro_fed_start", "query.numpyro_fed_call"
STATE = "query.numpyro_fed_state"  # init_state and the calls of the clients' stateful functions


class _NodeLoader:
    """The server's stand-in for the nodes' loaders: each node loads its rows with the app's
    loader and its own node config; the server never runs it."""

    __name__ = "node_loader"

    def __call__(self, m):
        raise RuntimeError("on Flower each node loads its own rows; the server holds no loader")

    def __repr__(self):
        return "node_loader"


NODE_LOADER = _NodeLoader()


def _import_flwr():
    from numpyro_fed.flower import _import_flwr as imp

    return imp()


@jax.tree_util.register_pytree_node_class
class FlowerFederation(Federation):
    """Clients as Flower SuperNodes, each loading its own rows: the backend of
    :func:`numpyro_fed.flower.server_app` (use it inside a ``ServerApp``'s main function;
    :func:`numpyro_fed.flower.run` makes one).

    Always deployment: the nodes' loaders give the rows (no row crosses the wire), so methods
    run without data arguments. Client ``m`` is the node whose node config has
    ``partition-id = m`` (Flower's simulation sets it; give it to each SuperNode with
    ``--node-config``), or, if the nodes have none, the ``m``-th node by id.

    :param grid: the ``Grid`` of the ``ServerApp``.
    :param int num_clients: the nodes to wait for (``None``: those connected, at least one).
    :param float timeout: seconds to wait for the replies of one call.
    :param float start_timeout: seconds to wait for the nodes to connect, describe their rows
        and build their programs (a node compiles its functions on its first call: the first
        call of each function may take ``timeout`` more).
    :param str method_name: the name of the method in the app (see :class:`Recipe`).
    """

    def __init__(self, grid, *, num_clients: int | None = None, timeout: float = 120.0,
                 start_timeout: float = 600.0):
        if not timeout > 0 or not start_timeout > 0:
            raise ValueError(f"timeout and start_timeout must be > 0, not {timeout}, {start_timeout}")
        self.grid = grid
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self._nodes = self._wait_for_nodes(num_clients)
        super().__init__(loader=NODE_LOADER, num_clients=len(self._nodes))
        self.recipe = None  # set by numpyro_fed.flower.run before the method starts its clients
        self._descriptions = None
        self._specs = None
        self._reply_cache = {}
        self._error = None
        self._state_struct = None  # one client's state: ShapeDtypeStructs (set by init_state)

    # -- pytree: no leaves, like RayFederation -------------------------------------------------
    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, federation, children):
        return federation

    # -- nodes ---------------------------------------------------------------------------------
    def _wait_for_nodes(self, num_clients):
        deadline = time.monotonic() + self.start_timeout
        want = 1 if num_clients is None else int(num_clients)
        if want < 1:
            raise ValueError(f"num_clients must be >= 1, not {num_clients}")
        while True:
            nodes = sorted(int(n) for n in self.grid.get_node_ids())
            if len(nodes) >= want:
                if num_clients is not None and len(nodes) > want:
                    raise ValueError(f"{len(nodes)} Flower nodes are connected but num_clients={num_clients}: "
                                     "run one node per client")
                return nodes
            if time.monotonic() > deadline:
                raise ClientError(f"{len(nodes)} Flower node(s) connected within {self.start_timeout} s; "
                                  f"the run needs {want} (start the SuperNodes, or lower num_clients)",
                                  call="connect")
            time.sleep(0.2)

    @property
    def nodes(self) -> list[int]:
        """Client ``m``'s Flower node id is ``nodes[m]``."""
        return list(self._nodes)

    def _send(self, kind: str, contents: dict, *, timeout: float, call: str) -> dict:
        """Sends ``{client: RecordDict}`` as messages of type ``kind``; returns ``{client:
        reply content}``, or raises a :class:`ClientError` naming the clients that failed
        (with the node's own message) or did not answer within ``timeout``."""
        flwr = _import_flwr()
        messages, owner = [], {}
        for m, content in contents.items():
            message = flwr.app.Message(content, dst_node_id=self._nodes[m], message_type=kind,
                                       ttl=max(timeout, 60.0))
            messages.append(message)
            owner[self._nodes[m]] = m
        replies = self.grid.send_and_receive(messages, timeout=timeout)
        results, failures = {}, []
        for reply in replies:
            m = owner.get(int(reply.metadata.src_node_id))
            if m is None:
                continue
            if reply.has_error():
                failures.append((m, f"failed: {_reason(reply.error.reason)}"))
            else:
                results[m] = reply.content
        failed = {m for m, _ in failures}
        silent = [m for m in contents if m not in results and m not in failed]
        if failures or silent:
            parts = [f"client {m} (Flower node {self._nodes[m]}) {why}" for m, why in sorted(failures)]
            if silent:
                nodes = [self._nodes[m] for m in silent]
                parts.append(f"client(s) {silent} (Flower node(s) {nodes}) did not answer within {timeout} s")
            error = ClientError(f"call '{call}': " + "; ".join(parts),
                                clients=sorted(failed) + silent, call=call)
            self._error = error
            raise error
        return results

    # -- host side -----------------------------------------------------------------------------
    def describe(self, loader, num_clients):
        """Each node runs the app's loader on its node config and reports shapes, dtypes,
        row counts and scalar settings (never rows); orders the nodes by their
        ``partition-id``."""
        flwr = _import_flwr()
        if int(num_clients) != len(self._nodes):
            raise ValueError(f"num_clients={num_clients}, but {len(self._nodes)} Flower nodes are connected")
        contents = {m: flwr.app.RecordDict({"numpyro_fed": flwr.app.ConfigRecord({"call": "describe"})})
                    for m in range(len(self._nodes))}
        replies = self._send(DESCRIBE, contents, timeout=self.start_timeout, call="describe")
        partition = {m: int(r["numpyro_fed"]["partition_id"]) for m, r in replies.items()}
        descriptions = {m: str(r["numpyro_fed"]["description"]) for m, r in replies.items()}
        ids = sorted(partition.values())
        if all(p >= 0 for p in ids):
            if ids != list(range(len(ids))):
                raise ValueError(f"the nodes' partition-id values are {ids}; they must be 0, ..., {len(ids) - 1} "
                                 "(one node per client)")
            order = sorted(partition, key=partition.get)
        elif any(p >= 0 for p in ids):
            raise ValueError("some nodes have a partition-id in their node config and some do not: give every "
                             "node one, or none (then clients are ordered by node id)")
        else:
            order = list(range(len(self._nodes)))
        self._nodes = [self._nodes[m] for m in order]
        self._descriptions = [descriptions[m] for m in order]
        return [decode_description(d) for d in self._descriptions]

    def start(self, program: ClientProgram) -> "FlowerFederation":
        """Sends each node the recipe of the run (see :mod:`numpyro_fed.flower`); each
        rebuilds the program from the app's own code, loads its rows and reports its block's
        shapes. No code and no row crosses the wire."""
        from numpyro_fed.flower._replay import Recipe

        flwr = _import_flwr()
        if not isinstance(program, ClientProgram):
            raise TypeError(f"start takes a ClientProgram, not {type(program).__name__}")
        if program.blocks is not None:
            raise ValueError("FlowerFederation ships no rows: each node loads its own (run the method without "
                             "data arguments; the federation's nodes give the rows)")
        if self.recipe is None or self._descriptions is None:
            raise RuntimeError("FlowerFederation runs methods through numpyro_fed.flower.run (it tells the "
                               "nodes which method and call to rebuild)")
        if program.num_clients != len(self._nodes):
            raise ValueError(f"the program has {program.num_clients} clients, {len(self._nodes)} nodes are connected")
        recipe = Recipe(self.recipe["name"], self.recipe["rng_key"], self.recipe["num_rounds"],
                        bool(jax.config.jax_enable_x64), self._descriptions, len(self._nodes))
        config = recipe.to_config()
        functions = sorted(program.functions) + sorted(f"stateful:{n}" for n in program.stateful)
        contents = {m: flwr.app.RecordDict({"numpyro_fed": flwr.app.ConfigRecord(
            {**config, "client": m, "functions": json_list(functions)})}) for m in range(len(self._nodes))}
        self._program, self._specs, self._reply_cache, self._state_struct = None, None, {}, None
        self._ledger = MessageLedger(program.num_clients)
        replies = self._send(START, contents, timeout=self.start_timeout, call="start")
        specs = []
        for m in range(len(self._nodes)):
            record = replies[m]["numpyro_fed"]
            spec = decode_description(str(record["block"]))
            specs.append(spec)
        self._specs = specs
        self._program = program
        self._recipe_digest = recipe.digest
        return self

    def restart(self, clients=None) -> "FlowerFederation":
        """After a :class:`~numpyro_fed.federation.ClientError`: waits for the nodes (a node
        that restarted may come back with another id; its ``partition-id`` finds it). The
        next :meth:`start` sends every node the recipe again."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            nodes = sorted(int(n) for n in self.grid.get_node_ids())
            if len(nodes) >= len(self._nodes):
                break
            if time.monotonic() > deadline:
                raise ClientError(f"{len(nodes)} Flower node(s) connected within {self.start_timeout} s; the run "
                                  f"needs {len(self._nodes)}", call="restart")
            time.sleep(0.2)
        if set(self._nodes) - set(nodes):  # a node came back under a new id: ask them all
            self._nodes = nodes[:len(self._nodes)]
            self.describe(self.loader, len(self._nodes))
        return self

    @property
    def block_specs(self) -> list:
        if self._specs is None:
            raise RuntimeError("FlowerFederation has not been started")
        return list(self._specs)

    @contextlib.contextmanager
    def guard(self):
        self._error = None
        try:
            yield
        except Exception as exc:  # JAX re-raises callback errors wrapped
            error, self._error = self._error, None
            if error is not None:
                raise error from exc
            raise
        error, self._error = self._error, None
        if error is not None:
            raise error

    # -- client state ----------------------------------------------------------------------------
    def init_state(self, initial) -> ClientState:
        """Sends each node its slice of ``initial`` (leading axis ``M``) as version 0 of its
        client state, which the node keeps in Flower's ``context.state``; the returned
        :class:`~numpyro_fed.federation.ClientState` holds the versions only (its ``values``
        are ``()``: the states live on the nodes)."""
        flwr = _import_flwr()
        initial = jax.tree_util.tree_map(np.asarray, self._check_initial_state(initial))
        contents = {}
        for m in range(self.num_clients):
            structure, leaves = encode_tree(jax.tree_util.tree_map(lambda a, m=m: a[m], initial))
            contents[m] = flwr.app.RecordDict({
                "numpyro_fed": flwr.app.ConfigRecord({"call": "init_state", "structure": structure}),
                "args": flwr.app.ArrayRecord(leaves)})
        self._send(STATE, contents, timeout=self.timeout, call="init_state")
        self._record_init_state(initial)
        self.ledger.round_trips += 1
        self._state_struct = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), initial)
        return ClientState((), jnp.zeros(self.num_clients, jnp.int32))

    def _stateful_reply_struct(self, name, arg_structs):
        if self._state_struct is None:
            raise RuntimeError(f"call '{name}' with a client state: call init_state(initial) on this federation first")
        key = ("stateful", name, tuple(jax.tree_util.tree_leaves(arg_structs)), jax.tree_util.tree_structure(arg_structs))
        if key not in self._reply_cache:
            new_state, reply = jax.eval_shape(self._stateful_function(name), self.block_specs[0], self._state_struct,
                                              *arg_structs)
            if new_state != self._state_struct:
                raise ValueError(f"stateful function '{name}' returns a state of structure {new_state}, the clients' "
                                 f"state has {self._state_struct}")
            self._reply_cache[key] = reply
        return self._reply_cache[key]

    def _check_remote_state(self, name, state):
        if not isinstance(state, ClientState):
            raise TypeError(f"call '{name}': state must be a ClientState (from init_state), got {type(state).__name__}")
        if jax.tree_util.tree_leaves(state.values):
            raise ValueError(f"call '{name}': this ClientState holds its values in this process (an InProcess "
                             "federation's); on Flower the nodes hold them: create it with this federation's init_state")

    def _unbatched(self, name, host_leaves, ndims):
        batch, flat, _ = _unbatch([np.asarray(x) for x in host_leaves], ndims)
        if batch:
            error = ValueError(f"call '{name}' with a client state cannot be batched (vmap) over chains on Flower: "
                               "each node holds one state")
            self._error = error
            raise error
        return flat

    def _call_stateful(self, name, requests: dict):
        """``{client: (args, version)}`` -> ``({client: reply leaves}, {client: new version}, sent)``."""
        flwr = _import_flwr()
        contents, sent = {}, {}
        for m, (args, version) in requests.items():
            structure, leaves = encode_tree(tuple(args))
            contents[m] = flwr.app.RecordDict({
                "numpyro_fed": flwr.app.ConfigRecord({"call": name, "structure": structure, "version": int(version)}),
                "args": flwr.app.ArrayRecord(leaves)})
            sent[m] = sum(a.nbytes for a in leaves)
        replies = self._send(STATE, contents, timeout=self.timeout, call=name)
        self.ledger.round_trips += 1
        out = {m: replies[m]["reply"].to_numpy_ndarrays() for m in requests}
        versions = {m: int(replies[m]["numpyro_fed"]["version"]) for m in requests}
        return out, versions, sent

    def _map_stateful(self, name, broadcast, per_client, state):
        self._check_remote_state(name, state)
        m_clients = self.num_clients
        struct = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # noqa: E731
        own_structs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)),
                                             per_client)
        for leaf in jax.tree_util.tree_leaves(per_client):
            if jnp.shape(leaf)[:1] != (m_clients,):
                raise ValueError(f"call '{name}': per_client arrays need a leading axis of {m_clients} clients, got "
                                 f"shape {jnp.shape(leaf)}")
        reply = self._stateful_reply_struct(name, tuple(jax.tree_util.tree_map(struct, broadcast)) + tuple(own_structs))
        out_struct = (jax.ShapeDtypeStruct((m_clients,), jnp.int32),
                      jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((m_clients,) + tuple(s.shape), s.dtype),
                                             reply))
        leaves, treedef = jax.tree_util.tree_flatten((broadcast, per_client))
        ndims = [1] + [jnp.ndim(x) for x in leaves]
        num_broadcast = len(jax.tree_util.tree_leaves(broadcast))
        reply_leaves, reply_def = jax.tree_util.tree_flatten(reply)

        def host(version, *host_leaves):
            flat = self._unbatched(name, (version,) + host_leaves, ndims)
            version, flat = flat[0], flat[1:]
            requests = {}
            for m in range(m_clients):
                args = [leaf[m] if i >= num_broadcast else leaf for i, leaf in enumerate(flat)]
                b, p = jax.tree_util.tree_unflatten(treedef, args)
                requests[m] = (tuple(b) + tuple(p), int(version[m]))
            replies, versions, sent = self._call_stateful(name, requests)
            out = [np.stack([np.asarray(replies[m][j], dtype=want.dtype) for m in range(m_clients)])
                   .reshape((m_clients,) + tuple(want.shape)) for j, want in enumerate(reply_leaves)]
            self._count(name, sent, replies, 1)
            return (np.asarray([versions[m] for m in range(m_clients)], np.int32),
                    jax.tree_util.tree_unflatten(reply_def, out))

        new_version, replies = jax.pure_callback(host, out_struct, jnp.asarray(state.version, jnp.int32), *leaves,
                                                 vmap_method="expand_dims")
        return ClientState((), new_version), replies

    def _one_stateful(self, name, client, broadcast, own, state):
        self._check_remote_state(name, state)
        m_clients = self.num_clients
        struct = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # noqa: E731
        own_structs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), own)
        reply = self._stateful_reply_struct(name, tuple(jax.tree_util.tree_map(struct, broadcast)) + tuple(own_structs))
        client = jnp.asarray(client, dtype=jnp.int32)
        if client.ndim > 1:
            raise ValueError(f"call '{name}': client must be an index or a 1-d array of them, got shape {client.shape}")
        lead = tuple(client.shape)
        out_struct = (jax.ShapeDtypeStruct((m_clients,), jnp.int32),
                      jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(lead + tuple(s.shape), s.dtype), reply))
        leaves, treedef = jax.tree_util.tree_flatten((broadcast, own))
        ndims = [client.ndim, 1] + [jnp.ndim(x) for x in leaves]
        num_broadcast = len(jax.tree_util.tree_leaves(broadcast))
        reply_leaves, reply_def = jax.tree_util.tree_flatten(reply)

        def host(chosen, version, *host_leaves):
            flat = self._unbatched(name, (chosen, version) + host_leaves, ndims)
            chosen, version, flat = np.asarray(flat[0]).reshape(-1), np.array(flat[1], np.int32), flat[2:]
            bad = [int(c) for c in chosen if not 0 <= c < m_clients]
            if bad or len(set(chosen.tolist())) != chosen.size:
                error = ClientError(f"call '{name}': clients {chosen.tolist()} must be distinct clients among "
                                    f"0..{m_clients - 1}", clients=bad, call=name)
                self._error = error
                raise error
            requests = {}
            for c in chosen.tolist():
                args = [leaf[c] if i >= num_broadcast else leaf for i, leaf in enumerate(flat)]
                b, o = jax.tree_util.tree_unflatten(treedef, args)
                requests[c] = (tuple(b) + tuple(o), int(version[c]))
            replies, versions, sent = self._call_stateful(name, requests)
            out = [np.stack([np.asarray(replies[c][j], dtype=want.dtype) for c in chosen.tolist()])
                   .reshape(lead + tuple(want.shape)) for j, want in enumerate(reply_leaves)]
            for c, v in versions.items():
                version[c] = v
            self._count(name, sent, replies, 1)
            return version, jax.tree_util.tree_unflatten(reply_def, out)

        new_version, reply_out = jax.pure_callback(host, out_struct, client, jnp.asarray(state.version, jnp.int32),
                                                   *leaves, vmap_method="expand_dims")
        return ClientState((), new_version), reply_out

    # -- traceable side ------------------------------------------------------------------------
    def _reply_struct(self, name, arg_structs):
        key = (name, tuple(jax.tree_util.tree_leaves(arg_structs)), jax.tree_util.tree_structure(arg_structs))
        if key not in self._reply_cache:
            self._reply_cache[key] = jax.eval_shape(self._function(name), self.block_specs[0], *arg_structs)
        return self._reply_cache[key]

    def _call(self, name, requests: dict) -> dict:
        """``{client: (args, in_axes)}`` -> ``{client: reply leaves}``; counts the ledger."""
        flwr = _import_flwr()
        contents, sent = {}, {}
        for m, (args, in_axes) in requests.items():
            structure, leaves = encode_tree(tuple(args))
            axes = [] if in_axes is None else [-1 if a is None else int(a) for a in in_axes]
            contents[m] = flwr.app.RecordDict({
                "numpyro_fed": flwr.app.ConfigRecord({"call": name, "structure": structure,
                                                      "batched": in_axes is not None, "in_axes": axes}),
                "args": flwr.app.ArrayRecord(leaves),
            })
            sent[m] = sum(a.nbytes for a in leaves)
        replies = self._send(CALL, contents, timeout=self.timeout, call=name)
        out = {m: replies[m]["reply"].to_numpy_ndarrays() for m in requests}
        self.ledger.round_trips += 1
        return out, sent

    def _count(self, name, sent, replies, messages):
        for m, nbytes in sent.items():
            n = messages[m] if isinstance(messages, dict) else messages
            self.ledger.add(name, "to_client", m, messages=n, nbytes=nbytes, rounds=n)
            self.ledger.add(name, "from_client", m, messages=n, nbytes=sum(a.nbytes for a in replies[m]))

    def map(self, name, *broadcast, per_client=(), state=None):
        per_client = tuple(per_client)
        if state is not None:
            return self._map_stateful(name, broadcast, per_client, state)
        m_clients = self.num_clients
        struct = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # noqa: E731
        own_structs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)),
                                             per_client)
        for leaf in jax.tree_util.tree_leaves(per_client):
            if jnp.shape(leaf)[:1] != (m_clients,):
                raise ValueError(f"call '{name}': per_client arrays need a leading axis of {m_clients} "
                                 f"clients, got shape {jnp.shape(leaf)}")
        reply = self._reply_struct(name, tuple(jax.tree_util.tree_map(struct, broadcast)) + tuple(own_structs))
        out_struct = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct((m_clients,) + tuple(s.shape), s.dtype), reply)
        leaves, treedef = jax.tree_util.tree_flatten((broadcast, per_client))
        ndims = [jnp.ndim(x) for x in leaves]
        num_broadcast = len(jax.tree_util.tree_leaves(broadcast))
        reply_leaves, reply_def = jax.tree_util.tree_flatten(reply)

        def host(*host_leaves):
            batch, flat, axes = _unbatch([np.asarray(x) for x in host_leaves], ndims)
            requests = {}
            for m in range(m_clients):
                args, args_axes = [], []
                for i, (leaf, axis) in enumerate(zip(flat, axes)):
                    if i >= num_broadcast:
                        leaf = leaf[:, m] if axis == 0 else leaf[m]
                    args.append(leaf)
                    args_axes.append(axis)
                b, p = jax.tree_util.tree_unflatten(treedef, args)
                in_axes = None if all(a is None for a in args_axes) else args_axes
                requests[m] = (tuple(b) + tuple(p), in_axes)
            replies, sent = self._call(name, requests)
            size = int(np.prod(batch)) if batch else 1
            out = []
            for j, want in enumerate(reply_leaves):
                per = []
                for m in range(m_clients):
                    value = np.asarray(replies[m][j], dtype=want.dtype)
                    if batch and value.ndim == want.ndim:
                        value = np.broadcast_to(value, (size,) + value.shape)
                    per.append(value)
                stacked = np.stack(per, axis=1 if batch else 0)
                out.append(stacked.reshape(tuple(batch) + (m_clients,) + tuple(want.shape)))
            self._count(name, sent, replies, size)
            return jax.tree_util.tree_unflatten(reply_def, out)

        return jax.pure_callback(host, out_struct, *leaves, vmap_method="expand_dims")

    def one(self, name, client, *broadcast, own=(), state=None):
        own = tuple(own)
        if state is not None:
            return self._one_stateful(name, client, broadcast, own, state)
        m_clients = self.num_clients
        struct = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # noqa: E731
        own_structs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), own)
        reply = self._reply_struct(name, tuple(jax.tree_util.tree_map(struct, broadcast)) + tuple(own_structs))
        client = jnp.asarray(client, dtype=jnp.int32)
        leaves, treedef = jax.tree_util.tree_flatten((client, broadcast, own))
        ndims = [jnp.ndim(x) for x in leaves]
        num_broadcast = len(jax.tree_util.tree_leaves(broadcast))
        reply_leaves, reply_def = jax.tree_util.tree_flatten(reply)

        def host(*host_leaves):
            batch, flat, axes = _unbatch([np.asarray(x) for x in host_leaves], ndims)
            size = int(np.prod(batch)) if batch else 1
            chosen = np.broadcast_to(flat[0], (size,)) if batch else np.asarray(flat[0]).reshape(1)
            requests, members = {}, {}
            for c in np.unique(chosen):
                c = int(c)
                if not 0 <= c < m_clients:
                    raise ClientError(f"call '{name}': no client {c} (there are {m_clients})", clients=[c], call=name)
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
                in_axes = None if all(a is None for a in args_axes) else args_axes
                requests[c] = (tuple(b) + tuple(o), in_axes)
            replies, sent = self._call(name, requests)
            out = []
            for j, want in enumerate(reply_leaves):
                if not batch:
                    value = np.asarray(replies[int(chosen[0])][j], dtype=want.dtype)
                    out.append(value.reshape(want.shape))
                    continue
                full = np.empty((size,) + tuple(want.shape), want.dtype)
                for c, idx in members.items():
                    value = np.asarray(replies[c][j], dtype=want.dtype)
                    full[idx] = value if value.ndim > want.ndim else value[None]
                out.append(full.reshape(tuple(batch) + tuple(want.shape)))
            self._count(name, sent, replies, {c: len(idx) for c, idx in members.items()})
            return jax.tree_util.tree_unflatten(reply_def, out)

        return jax.pure_callback(host, reply, *leaves, vmap_method="expand_dims")

    def __repr__(self) -> str:
        state = f"num_clients={self.num_clients}" if self._program is not None else f"{len(self._nodes)} nodes"
        return f"FlowerFederation({state}, timeout={self.timeout})"


def json_list(values) -> str:
    import json

    return json.dumps(list(values))


def _reason(text: str) -> str:
    """A node's error as the node's own message (the last line Flower's traceback names)."""
    text = str(text)
    marker = "numpyro_fed node error: "
    if marker in text:
        return text.split(marker, 1)[1].split("\n", 1)[0].strip().rstrip("'>")
    if "Message: " in text:  # Flower's ClientAppException around what the app raised
        return text.rsplit("Message: ", 1)[1].split("\n", 1)[0].strip().rstrip("'>").strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "error"
