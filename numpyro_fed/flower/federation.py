"""The server's side of Flower: :class:`FlowerFederation`, a
:class:`~numpyro_fed.federation.remote.RemoteFederation` whose clients are Flower
SuperNodes, used inside a ``ServerApp``.

Its transport hooks send the clients' requests as Flower Messages through the ``Grid``
(``grid.send_and_receive`` with a timeout) and wait for their replies; the traceable
:meth:`~FlowerFederation.map` and :meth:`~FlowerFederation.one` are the base's, as on Ray, so
an algorithm's core runs unchanged. The ledger counts the arrays of the messages really sent
and received.
"""

from __future__ import annotations

import time

import jax

from numpyro_fed.federation.base import ClientError, ClientProgram
from numpyro_fed.federation.remote import RemoteFederation
from numpyro_fed.flower._wire import decode_description, encode_tree
from numpyro_fed.flower.clientapp import import_flwr

__all__ = ["FlowerFederation", "NODE_LOADER", "import_flwr"]

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


@jax.tree_util.register_pytree_node_class
class FlowerFederation(RemoteFederation):
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
    """

    def __init__(self, grid, *, num_clients: int | None = None, timeout: float = 120.0, start_timeout: float = 600.0):
        if not timeout > 0 or not start_timeout > 0:
            raise ValueError(f"timeout and start_timeout must be > 0, not {timeout}, {start_timeout}")
        self.grid = grid
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self._nodes = self._wait_for_nodes(num_clients)
        super().__init__(loader=NODE_LOADER, num_clients=len(self._nodes))
        self.recipe = None  # set by numpyro_fed.flower.run before the method starts its clients
        self._descriptions = None

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
                    raise ValueError(
                        f"{len(nodes)} Flower nodes are connected but num_clients={num_clients}: "
                        "run one node per client"
                    )
                return nodes
            if time.monotonic() > deadline:
                raise ClientError(
                    f"{len(nodes)} Flower node(s) connected within {self.start_timeout} s; "
                    f"the run needs {want} (start the SuperNodes, or lower num_clients)",
                    call="connect",
                )
            time.sleep(0.2)

    @property
    def nodes(self) -> list[int]:
        """Client ``m``'s Flower node id is ``nodes[m]``."""
        return list(self._nodes)

    def _send(self, kind: str, contents: dict, *, timeout: float, call: str) -> dict:
        """Sends ``{client: RecordDict}`` as messages of type ``kind``; returns ``{client:
        reply content}``, or raises a :class:`ClientError` naming the clients that failed
        (with the node's own message) or did not answer within ``timeout``."""
        flwr = import_flwr()
        messages, owner = [], {}
        for m, content in contents.items():
            message = flwr.app.Message(content, dst_node_id=self._nodes[m], message_type=kind, ttl=max(timeout, 60.0))
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
            error = ClientError(
                f"call '{call}': " + "; ".join(parts), clients=sorted(failed) + silent, call=call, replies=results
            )
            self._error = error
            raise error
        return results

    # -- host side -----------------------------------------------------------------------------
    def describe(self, loader, num_clients):
        """Each node runs the app's loader on its node config and reports shapes, dtypes,
        row counts and scalar settings (never rows); orders the nodes by their
        ``partition-id``."""
        flwr = import_flwr()
        if int(num_clients) != len(self._nodes):
            raise ValueError(f"num_clients={num_clients}, but {len(self._nodes)} Flower nodes are connected")
        contents = {
            m: flwr.app.RecordDict({"numpyro_fed": flwr.app.ConfigRecord({"call": "describe"})})
            for m in range(len(self._nodes))
        }
        replies = self._send(DESCRIBE, contents, timeout=self.start_timeout, call="describe")
        partition = {m: int(r["numpyro_fed"]["partition_id"]) for m, r in replies.items()}
        descriptions = {m: str(r["numpyro_fed"]["description"]) for m, r in replies.items()}
        ids = sorted(partition.values())
        if all(p >= 0 for p in ids):
            if ids != list(range(len(ids))):
                raise ValueError(
                    f"the nodes' partition-id values are {ids}; they must be 0, ..., {len(ids) - 1} "
                    "(one node per client)"
                )
            order = sorted(partition, key=partition.get)
        elif any(p >= 0 for p in ids):
            raise ValueError(
                "some nodes have a partition-id in their node config and some do not: give every "
                "node one, or none (then clients are ordered by node id)"
            )
        else:
            order = list(range(len(self._nodes)))
        self._nodes = [self._nodes[m] for m in order]
        self._descriptions = [descriptions[m] for m in order]
        return [decode_description(d) for d in self._descriptions]

    def start(self, program: ClientProgram) -> "FlowerFederation":
        """Sends each node the recipe of the run (see :mod:`numpyro_fed.flower`); each
        rebuilds the program from the app's own code, loads its rows and reports its block's
        shapes. No code and no row crosses the wire."""
        return super().start(program)

    def start_clients(self, program: ClientProgram) -> list:
        from numpyro_fed.flower.recipe import Recipe

        flwr = import_flwr()
        if program.blocks is not None:
            raise ValueError(
                "FlowerFederation ships no rows: each node loads its own (run the method without "
                "data arguments; the federation's nodes give the rows)"
            )
        if self.recipe is None or self._descriptions is None:
            raise RuntimeError(
                "FlowerFederation runs methods through numpyro_fed.flower.run (it tells the "
                "nodes which method and call to rebuild)"
            )
        if program.num_clients != len(self._nodes):
            raise ValueError(f"the program has {program.num_clients} clients, {len(self._nodes)} nodes are connected")
        recipe = Recipe(
            self.recipe["name"],
            self.recipe["rng_key"],
            self.recipe["num_rounds"],
            bool(jax.config.jax_enable_x64),
            self._descriptions,
            len(self._nodes),
        )
        config = recipe.to_config()
        functions = sorted(program.functions) + sorted(f"stateful:{n}" for n in program.stateful)
        contents = {
            m: flwr.app.RecordDict(
                {"numpyro_fed": flwr.app.ConfigRecord({**config, "client": m, "functions": json_list(functions)})}
            )
            for m in range(len(self._nodes))
        }
        self._state_struct = None
        replies = self._send(START, contents, timeout=self.start_timeout, call="start")
        self._recipe_digest = recipe.digest
        return [decode_description(str(replies[m]["numpyro_fed"]["block"])) for m in range(len(self._nodes))]

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
                raise ClientError(
                    f"{len(nodes)} Flower node(s) connected within {self.start_timeout} s; the run "
                    f"needs {len(self._nodes)}",
                    call="restart",
                )
            time.sleep(0.2)
        if set(self._nodes) - set(nodes):  # a node came back under a new id: ask them all
            self._nodes = nodes[: len(self._nodes)]
            self.describe(self.loader, len(self._nodes))
        return self

    # -- transport hooks (see RemoteFederation) ------------------------------------------------
    @staticmethod
    def _message(name, tree, **config):
        """A request's content: the call's name and the structure of ``tree`` (JSON) with
        ``config``, and ``tree``'s arrays."""
        flwr = import_flwr()
        structure, leaves = encode_tree(tree)
        return flwr.app.RecordDict(
            {
                "numpyro_fed": flwr.app.ConfigRecord({"call": name, "structure": structure, **config}),
                "args": flwr.app.ArrayRecord(leaves),
            }
        )

    def send_initial_state(self, slices):
        """Each node keeps its slice in Flower's ``context.state``."""
        self._send(
            STATE,
            {m: self._message("init_state", value) for m, value in slices.items()},
            timeout=self.timeout,
            call="init_state",
        )

    def send_calls(self, name, calls):
        contents = {}
        for m, call in calls.items():
            args = tuple(call.args)
            axes = (
                []
                if call.in_axes is None
                else [
                    -1 if a is None else int(a) for a in jax.tree_util.tree_structure(args).flatten_up_to(call.in_axes)
                ]
            )
            contents[m] = self._message(name, args, batched=call.in_axes is not None, in_axes=axes)
        return self._replies(CALL, contents, name, lambda r: r["reply"].to_numpy_ndarrays())

    def send_stateful_calls(self, name, calls):
        contents = {m: self._message(name, tuple(call.args), version=int(call.version)) for m, call in calls.items()}
        return self._replies(
            STATE, contents, name, lambda r: (r["reply"].to_numpy_ndarrays(), int(r["numpyro_fed"]["version"]))
        )

    def _replies(self, kind, contents, name, read):
        """:meth:`_send`'s replies read by ``read``; a :class:`ClientError` carries those of
        the nodes that answered, read the same way (what a ``partial`` call goes on with)."""
        try:
            replies = self._send(kind, contents, timeout=self.call_timeout(name, self.timeout), call=name)
        except ClientError as error:
            error.replies = {m: read(r) for m, r in error.replies.items()}
            raise
        return {m: read(replies[m]) for m in contents}

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
