"""What a server may ask of its clients: :class:`Federation`, :class:`ClientProgram`,
:class:`ClientError` (and :class:`NetworkError`, a decentralized run's), and the helpers every
backend shares (message sizes, block checks)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed._checks import check_positive
from numpyro_fed.federation.ledger import MessageLedger

__all__ = [
    "ClientError",
    "ClientProgram",
    "ClientState",
    "Federation",
    "NetworkError",
    "block_spec",
    "check_block",
    "check_min_clients",
    "describe_arguments",
    "resolve_min_clients",
    "tree_nbytes",
]


class ClientError(RuntimeError):
    """A client died, stopped answering within the timeout, or failed a call.

    :ivar tuple clients: the indices of the clients at fault.
    :ivar str call: the name of the call that failed.
    :ivar dict replies: ``{client: reply}`` of the clients of the call that did answer (a
        transport hook's partial result: what a ``partial=True`` call goes on with).
    """

    def __init__(self, message: str, *, clients=(), call: str | None = None, replies=None):
        super().__init__(message)
        self.clients = tuple(int(c) for c in clients)
        self.call = call
        self.replies = dict(replies or {})


class NetworkError(ClientError):
    """A :class:`ClientError` of a decentralized run: an agent died, fell silent or failed.
    :attr:`clients` names it. What was computed before is kept:

    :ivar int iteration: the last iteration every agent completed and the sampler received.
    :ivar state: the sampler's state at :attr:`iteration` (with the chain axis of the run):
        resume with ``mcmc.post_warmup_state = error.state; mcmc.run(error.state.rng_key,
        ...)`` (a dead agent's actor is replaced).
    :ivar draws: every agent's iterates since the network started, by site (constrained),
        shaped ``(chains, iterations, agents, ...)``.
    """

    resume = None
    history = ()
    describe = None

    @property
    def state(self):
        return None if self.describe is None else self.describe(self.resume, self.history)[0]

    @property
    def draws(self):
        return None if self.describe is None else self.describe(self.resume, self.history)[1]


class ClientState(NamedTuple):
    """What the clients keep between their calls (their *client state*), as the server sees it.

    Created by :meth:`Federation.init_state`; passed to and returned by the stateful calls
    (``federation.map(name, ..., state=cs)``, ``federation.one(name, client, ...,
    state=cs)``), which run ``program.stateful[name](block, state, *args) -> (new_state,
    reply)`` where the client lives. Only the reply crosses the wire: the state never does
    (and the ledger never counts it).

    A pytree, so it travels in an algorithm's state through ``jit`` and ``lax`` loops.

    :ivar values: :class:`~numpyro_fed.federation.InProcess`: every client's state stacked on
        a leading axis ``M`` (the clients live in this process); a remote backend
        (:class:`~numpyro_fed.federation.RayFederation`): ``()``, the values live on the
        workers and the server never reads them.
    :ivar version: ``(M,)`` int32, the stateful calls each client has applied. A remote
        worker keeps its last two versions and a call names the version it starts from, so
        a call is a pure function of ``(version, arguments)``: a retried call gives the same
        reply, and a run resumed from its last completed round finds its version on the
        workers (a :class:`ClientError` naming the client says so when a worker does not hold
        it, e.g. one restarted without its saved state).

    >>> import jax.numpy as jnp
    >>> from numpyro_fed.federation import ClientProgram, InProcess
    >>> def count(block, total, w):  # the client adds what it is sent to its running total
    ...     total = total + (block * w).sum()
    ...     return total, total > 10.0  # (new state, the reply: only this crosses)
    >>> program = ClientProgram.stacked({}, jnp.arange(4.0).reshape(2, 2), stateful={"count": count})
    >>> fed = InProcess().start(program)
    >>> cs = fed.init_state(jnp.zeros(2))
    >>> cs, replies = fed.map("count", 2.0, state=cs)
    >>> cs, replies = fed.map("count", 2.0, state=cs)
    >>> replies.tolist(), cs.values.tolist(), cs.version.tolist()
    ([False, True], [4.0, 20.0], [2, 2])
    """

    values: Any
    version: Any


def tree_nbytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (arrays, ``ShapeDtypeStruct``s or scalars)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, (np.ndarray, np.generic)):  # a reply's arrays: the common case, without a dtype lookup
            total += leaf.nbytes
            continue
        shape = np.shape(leaf) if not hasattr(leaf, "shape") else leaf.shape
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            itemsize = 8  # a threefry key: two uint32 words
        else:
            itemsize = np.dtype(dtype).itemsize
        total += int(np.prod(shape, dtype=np.int64)) * itemsize
    return total


def block_spec(block):
    """The ``jax.ShapeDtypeStruct`` tree of a client block: what a worker reports to the
    server (shapes and dtypes, never values)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), block)


def describe_arguments(tree):
    """What a worker tells the server about its model arguments: a ``ShapeDtypeStruct`` for
    every array leaf with at least one axis (rows; never their values), the value of every
    scalar leaf (a setting such as a number of classes, not a row)."""

    def describe(leaf):
        if isinstance(leaf, (str, bytes)) or np.ndim(leaf) == 0:
            return leaf.item() if hasattr(leaf, "item") else leaf
        return jax.ShapeDtypeStruct(np.shape(leaf), np.asarray(leaf).dtype)

    return jax.tree_util.tree_map(describe, tree)


def check_min_clients(min_clients) -> int | None:
    """A method's ``min_clients=`` argument: ``None`` (every client must answer) or an int
    ``>= 1``; a ``ValueError`` naming it otherwise."""
    if min_clients is None:
        return None
    if isinstance(min_clients, bool) or not isinstance(min_clients, (int, np.integer)) or min_clients < 1:
        raise ValueError(f"min_clients must be None (every client) or an int >= 1, got {min_clients!r}")
    return int(min_clients)


def resolve_min_clients(min_clients, num_clients: int) -> int | None:
    """``min_clients`` for a run of ``num_clients`` clients: ``None`` when every client must
    answer (``None`` or ``num_clients``: a failure stops the run), else the int; a
    ``ValueError`` naming ``min_clients`` when it exceeds ``num_clients``."""
    min_clients = check_min_clients(min_clients)
    if min_clients is not None and min_clients > num_clients:
        raise ValueError(f"min_clients={min_clients} exceeds the number of clients, {num_clients}")
    return None if min_clients is None or min_clients == num_clients else min_clients


def check_block(block, client: int, spec=None, *, rows_axis_free: bool = True) -> None:
    """Refuses a client's block with a ``ValueError`` naming the client: non-finite floating
    values, or (given ``spec``, a ``ShapeDtypeStruct`` tree) another tree structure, dtype or
    shape. With ``rows_axis_free`` the leading axis of each leaf may differ from ``spec``'s
    (clients hold different numbers of rows)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(block)
    if spec is not None:
        spec_leaves, spec_def = jax.tree_util.tree_flatten(spec)
        if jax.tree_util.tree_structure(block) != spec_def:
            raise ValueError(
                f"client {client}: its data has structure {jax.tree_util.tree_structure(block)}, expected {spec_def}"
            )
    for i, (path, leaf) in enumerate(leaves):
        where = jax.tree_util.keystr(path) or "block"
        array = np.asarray(leaf)
        if spec is not None:
            want = spec_leaves[i]
            shape, wshape = array.shape, tuple(want.shape)
            same = (
                (shape[1:] == wshape[1:] and len(shape) == len(wshape))
                if rows_axis_free and len(wshape) > 0
                else shape == wshape
            )
            if not same:
                raise ValueError(
                    f"client {client}: {where} has shape {shape}, expected {wshape}"
                    + (" (any number of rows)" if rows_axis_free and wshape else "")
                )
            if array.dtype != np.dtype(want.dtype):
                raise ValueError(f"client {client}: {where} has dtype {array.dtype}, expected {want.dtype}")
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            first = np.argwhere(~np.isfinite(array))[0].tolist()
            raise ValueError(f"client {client}: {where} holds non-finite values (first at index {first})")


@dataclass(frozen=True)
class ClientProgram:
    """What every client runs: named pure functions of its block, and how it gets its block.

    Give exactly one of ``blocks`` and ``loader``.

    :ivar dict functions: name -> pure JAX function ``f(block, *args) -> reply`` (a pytree of
        arrays). The server calls them by name through :meth:`Federation.map` and
        :meth:`Federation.one`. They must be picklable (module-level functions or closures
        over arrays that are not client rows) for engine backends.
    :ivar blocks: simulation: one pytree per client (a sequence of length ``M``); worker
        ``m`` receives ``blocks[m]`` and nothing else. :meth:`stacked` builds it from a pytree
        with a leading client axis.
    :ivar loader: deployment: ``loader(m) -> block``, run on worker ``m`` (the driver never
        holds a block; with :class:`InProcess` it runs in the driver's process).
    :ivar int num_clients: ``M``; required with ``loader``.
    :ivar spec: an optional ``ShapeDtypeStruct`` tree every block must match (the leading
        axis of each leaf, the rows, may differ); blocks are also refused if they hold
        non-finite floats.
    :ivar dict stateful: functions of the client's own state (see :class:`ClientState`):
        name -> ``f(block, state, *args) -> (new_state, reply)``, ``state`` the client's
        slice of what :meth:`Federation.init_state` was given. Called by
        ``federation.map(name, ..., state=cs)`` and ``federation.one(name, client, ...,
        state=cs)``; the new state stays with the client, only ``reply`` comes back. Its
        names must differ from those of ``functions``.
    :ivar dict timeouts: name -> seconds a call of that function may take on an engine, in
        place of the federation's ``timeout`` (meant for one round of an iterative method):
        for a function whose one call is a client's whole run (the MCMC of
        :class:`~numpyro_fed.ConsensusMC`). On Ray a worker that dies is reported when the
        others have answered, without waiting this long.

    >>> import jax.numpy as jnp
    >>> from numpyro_fed.federation import ClientProgram
    >>> program = ClientProgram.stacked({"total": lambda block, w: (block * w).sum()},
    ...                                 jnp.arange(6.0).reshape(3, 2))
    >>> program.num_clients, program.blocks[1].tolist()
    (3, [2.0, 3.0])
    """

    functions: Mapping[str, Callable]
    blocks: Sequence[Any] | None = None
    loader: Callable[[int], Any] | None = None
    num_clients: int | None = None
    spec: Any = None
    stateful: Mapping[str, Callable] = field(default_factory=dict)
    timeouts: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if (self.blocks is None) == (self.loader is None):
            raise ValueError("ClientProgram takes exactly one of blocks= (simulation) and loader= (deployment)")
        if self.blocks is not None:
            n = len(self.blocks)
            if self.num_clients is not None and self.num_clients != n:
                raise ValueError(f"num_clients={self.num_clients} but {n} blocks were given")
            object.__setattr__(self, "blocks", tuple(self.blocks))
            object.__setattr__(self, "num_clients", n)
        elif self.num_clients is None:
            raise ValueError("ClientProgram(loader=...) needs num_clients")
        if int(self.num_clients) < 1:
            raise ValueError(f"num_clients must be >= 1, not {self.num_clients}")
        for name, fn in {**self.functions, **self.stateful}.items():
            if not callable(fn):
                raise TypeError(f"ClientProgram function '{name}' is not callable")
        both = sorted(set(self.functions) & set(self.stateful))
        if both:
            raise ValueError(f"ClientProgram: {both} named in both functions and stateful; give them different names")
        unknown = sorted(set(self.timeouts) - set(self.functions) - set(self.stateful))
        if unknown:
            raise ValueError(f"ClientProgram: timeouts name {unknown}, which the program has no function of")
        checked = {n: check_positive(s, f"ClientProgram: the timeout of '{n}'") for n, s in self.timeouts.items()}
        object.__setattr__(self, "timeouts", checked)

    @classmethod
    def stacked(cls, functions, stacked_blocks, **kwargs) -> "ClientProgram":
        """A program from a pytree whose leaves have a leading client axis ``M`` (e.g.
        :attr:`FederatedPotential.client_data <numpyro_fed.FederatedPotential.client_data>`)."""
        leaves = jax.tree_util.tree_leaves(stacked_blocks)
        if not leaves:
            raise ValueError("stacked_blocks has no array leaves")
        m = int(np.shape(leaves[0])[0])
        blocks = [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked_blocks) for i in range(m)]
        return cls(functions, blocks=blocks, **kwargs)


class Federation(abc.ABC):
    """What a server may ask of its clients; the seam between an algorithm and an engine.

    Host side: :meth:`start` (give the clients their program and rows), :meth:`init_state`
    (their initial client state), :meth:`close`, a context manager, :attr:`ledger`,
    :attr:`num_clients`. Traceable side, usable inside ``jax.jit``, ``lax.while_loop`` and
    ``vmap`` over chains, so an algorithm's core is written once for every backend:
    :meth:`map`, :meth:`one` (both with ``state=``: a call of the program's ``stateful``
    functions, see :class:`ClientState`). Decentralized algorithms (no server) run their
    agents on the backend's network: :meth:`agent_network` (and :meth:`agent_hosts` in
    deployment), where the backend :attr:`runs_agents`.

    Backends: :class:`~numpyro_fed.federation.InProcess` (the default: clients vectorised in
    this process) and :class:`~numpyro_fed.federation.RayFederation` (one actor per client).

    **Where the rows come from.** By default (simulation) an algorithm cuts the data it is
    run on and sends each client its own block. Given ``loader`` and ``num_clients``
    (deployment), the federation's clients load their own rows: ``loader(m)`` runs where
    client ``m`` lives (on its worker with ``RayFederation``) and returns client ``m``'s model
    arguments (a tuple of positional arguments or a dict of keyword arguments, rows first);
    the algorithms are then run without data arguments and the driver never holds a row (see
    :func:`~numpyro_fed.split_potential`).

    :param loader: deployment: ``m -> client m's model arguments``, run on client ``m``
        (picklable for engine backends: a module-level function, or one defined in the
        driver's script on a local Ray).
    :param int num_clients: ``M``, with ``loader``.
    """

    def __init__(self, *, loader: Callable[[int], Any] | None = None, num_clients: int | None = None):
        self._program: ClientProgram | None = None
        self._ledger: MessageLedger | None = None
        if loader is not None and not callable(loader):
            raise TypeError(f"loader must be a function m -> client m's model arguments, got {type(loader).__name__}")
        if (loader is None) != (num_clients is None):
            raise ValueError("give loader= and num_clients= together (deployment), or neither (simulation)")
        if num_clients is not None and int(num_clients) < 1:
            raise ValueError(f"num_clients must be >= 1, not {num_clients}")
        #: deployment: ``m -> client m's model arguments``, run on client ``m`` (else ``None``)
        self.loader = loader
        #: deployment: the number of clients that load their rows (else ``None``)
        self.loader_num_clients = None if num_clients is None else int(num_clients)

    @property
    def deployed(self) -> bool:
        """Whether the clients load their own rows (``loader`` given): algorithms then run
        without data arguments."""
        return self.loader is not None

    # -- capabilities (what a face may ask instead of testing the backend's type) ----------
    #: Whether the clients run inside the caller's compiled program, their blocks held in
    #: this process (:class:`~numpyro_fed.federation.InProcess`). ``False`` on engines,
    #: where every call crosses to a worker and values kept for the clients stay there.
    in_process: bool = False

    def restart(self, clients=None) -> "Federation":
        """Replaces clients that do not answer (an engine starts new workers that reload
        their rows and their saved client state); returns ``self``. A backend whose clients
        cannot fail (in process) has nothing to replace."""
        return self

    # -- host side -------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self, program: ClientProgram) -> "Federation":
        """Gives each client its program and block (or runs its loader); returns ``self``.
        Refuses bad blocks with a ``ValueError`` naming the client."""

    def close(self) -> None:
        """Releases the clients. The ledger stays readable."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def started(self) -> bool:
        return self._program is not None

    @property
    def program(self) -> ClientProgram:
        if self._program is None:
            raise RuntimeError(f"{type(self).__name__} has not been started: call start(program)")
        return self._program

    @property
    def num_clients(self) -> int:
        """``M``."""
        return int(self.program.num_clients)

    @property
    def ledger(self) -> MessageLedger:
        """The :class:`MessageLedger` of every call since :meth:`start`."""
        if self._ledger is None:
            raise RuntimeError(f"{type(self).__name__} has not been started: call start(program)")
        return self._ledger

    @property
    @abc.abstractmethod
    def block_specs(self) -> list:
        """Per client, the ``ShapeDtypeStruct`` tree of its block (as the worker reports it)."""

    def describe(self, loader: Callable[[int], Any], num_clients: int) -> list:
        """Runs ``loader(m)`` where client ``m`` lives and returns, per client,
        :func:`describe_arguments` of what it loaded: shapes, dtypes and scalar settings,
        never rows. (Deployment: the server builds its layout from these.)"""
        return [describe_arguments(loader(m)) for m in range(int(num_clients))]

    def init_state(self, initial) -> ClientState:
        """Gives each client its initial client state: client ``m`` receives its slice
        (leading axis ``M``) of ``initial``, a pytree of public values (e.g. zeros, or draws
        the server made), once; counted in the ledger as call ``"init_state"`` (the slice
        down, nothing up). Returns the :class:`ClientState` (version 0) to pass to the
        stateful calls. One client state per started federation: a second ``init_state``
        replaces its version 0 (the versions a run reached stay until its clients move on,
        so a run resumed from a checkpoint still finds them). Host side."""
        raise NotImplementedError(f"{type(self).__name__} keeps no client state")

    def _check_initial_state(self, initial):
        leaves = jax.tree_util.tree_leaves(initial)
        if not leaves:
            raise ValueError("init_state needs a pytree of arrays with a leading axis of one row per client")
        for leaf in leaves:
            if np.shape(leaf)[:1] != (self.num_clients,):
                raise ValueError(
                    f"init_state: every array needs a leading axis of {self.num_clients} clients, "
                    f"got shape {np.shape(leaf)}"
                )
        return jax.tree_util.tree_map(jnp.asarray, initial)

    def _record_init_state(self, initial) -> None:
        nbytes = tree_nbytes(initial) // self.num_clients
        self.ledger.add("init_state", "to_client", None, messages=1, nbytes=nbytes, rounds=1)
        self.ledger.add("init_state", "from_client", None, messages=1, nbytes=0)

    @contextlib.contextmanager
    def counted_by_caller(self):
        """Host side: calls traced inside this block are counted by their caller, in its own
        state, not by this federation (a sampler whose compiled loop calls the clients at
        every event, or an optimizer's loop). Only :class:`~numpyro_fed.federation.InProcess`,
        which counts a call with a host callback when it runs, stops counting; an engine
        backend counts every payload it sends.

        Yields ``count(name, calls)``, with which the caller reports how many times call
        ``name`` ran (an int for every client, or ``(M,)`` per client) when it wants them in
        this federation's ledger: ``InProcess`` adds them, with the sizes of the messages it
        traced; an engine, which counted them already, ignores them."""
        yield lambda name, calls: None

    @contextlib.contextmanager
    def guard(self):
        """Re-raises a :class:`ClientError` that a host callback met inside compiled code
        (JAX wraps it in a ``JaxRuntimeError``). Use around calls of compiled code that calls
        :meth:`map` or :meth:`one`."""
        self.keep_error(None)
        try:
            yield
        except Exception as exc:  # JAX re-raises callback errors as JaxRuntimeError or ValueError
            error = self._take_error()
            if error is not None:
                raise error from exc
            raise
        error = self._take_error()
        if error is not None:
            raise error

    def keep_error(self, error: ClientError | None) -> None:
        """Keeps ``error``, raised inside compiled code, for :meth:`guard` to re-raise as itself."""
        self._error = error

    def _take_error(self):
        error, self._error = getattr(self, "_error", None), None
        return error

    # -- clients that drop out -------------------------------------------------------------
    def _absences(self) -> dict:
        """``{client: why}`` of the clients whose last call failed (a ``partial`` call's)."""
        if not hasattr(self, "_absent_clients"):
            self._absent_clients = {}
        return self._absent_clients

    @property
    def absences(self) -> dict:
        """Host side: ``{client: why}``, the clients whose last call (of a ``partial=True``
        call) failed, and why; a client leaves it when it answers again."""
        return dict(self._absences())

    def _note_answers(self, name, calls, answered, why) -> None:
        """Host side: records who of ``calls`` answered call ``name`` (``answered``), in
        :attr:`absences` and in the ledger (``<name>/failed``)."""
        absences = self._absences()
        failed = [int(m) for m in calls if int(m) not in answered]
        for m in calls:
            absences.pop(int(m), None)
        for m in failed:
            absences[m] = why(m)
        if failed:
            self.ledger.add_failures(name, failed)

    def require(self, absent, min_clients: int, call: str = "update"):
        """Traceable: ``absent`` (``(M,)`` bool: the clients out of the run, e.g. those whose
        last visit failed) unchanged, when at least ``min_clients`` clients are not absent;
        otherwise, on the host, a :class:`ClientError` naming the absent clients (with why,
        from :attr:`absences`), kept for :meth:`guard`. What an algorithm whose calls are
        ``partial`` checks after each round."""
        m_clients = self.num_clients

        def host(absent):
            absent = np.asarray(absent, bool).reshape(m_clients)
            out = [int(m) for m in np.flatnonzero(absent)]
            if m_clients - len(out) < min_clients:
                absences = self._absences()
                why = "; ".join(f"client {m}: {absences.get(m, 'failed')}" for m in out)
                error = ClientError(
                    f"call '{call}': only {m_clients - len(out)} of {m_clients} clients answer, fewer than "
                    f"min_clients={min_clients} (client(s) {out} out: {why})",
                    clients=out,
                    call=call,
                )
                self.keep_error(error)
                raise error
            return absent

        return jax.pure_callback(
            host, jax.ShapeDtypeStruct((m_clients,), jnp.bool_), jnp.asarray(absent, bool), vmap_method="sequential"
        )

    # -- traceable side --------------------------------------------------------------------
    @abc.abstractmethod
    def map(self, name: str, *broadcast, per_client=(), state: ClientState | None = None, partial: bool = False):
        """Every client ``m`` runs ``functions[name](block_m, *broadcast, *own_m)``, ``own_m``
        being client ``m``'s slice (leading axis ``M``) of each array of ``per_client``;
        returns the replies stacked on a leading axis ``M``. Traceable.

        With ``state`` (a :class:`ClientState`), every client runs
        ``stateful[name](block_m, state_m, *broadcast, *own_m) -> (new_state_m, reply_m)``
        on its own state, keeps the new one, and the call returns ``(state', replies)``
        (every client's version one more).

        A client that fails or does not answer within the timeout raises a
        :class:`ClientError` naming it; with ``partial=True`` the call goes on with the
        others instead and returns ``answered`` too, ``(M,)`` bool, last: ``(replies,
        answered)`` or ``(state', replies, answered)``. A client that did not answer has
        zeros as its reply, its client state and version unchanged (it rejoins a later call
        from them: an engine first replaces a worker that died), its request counted in the
        ledger but no reply (``<name>/failed`` counts it), and is in :attr:`absences` until
        it answers again. Not under a ``vmap`` over chains."""

    @abc.abstractmethod
    def one(self, name: str, client, *broadcast, own=(), state: ClientState | None = None, partial: bool = False):
        """Client ``client`` (an int, possibly traced) runs ``functions[name](block, *broadcast,
        *own_c)``, ``own_c`` its slice of each array of ``own`` (leading axis ``M``); returns
        its reply. Traceable.

        With ``state`` (a :class:`ClientState`), the client runs ``stateful[name](block,
        state_c, *broadcast, *own_c) -> (new_state_c, reply)`` on its own state and keeps the
        new one; the call returns ``(state', reply)`` (that client's version one more).
        ``client`` may then also be a ``(C,)`` array of distinct clients, each running its
        call (in parallel on an engine): the replies have a leading axis ``C``.

        ``partial=True``: as :meth:`map`'s, ``answered`` (a bool, ``(C,)`` for ``C`` clients)
        returned last."""

    # -- decentralized agents (no server) -------------------------------------------------
    #: Whether the backend runs a decentralized algorithm's agents, each exchanging messages
    #: with its neighbours directly (:meth:`agent_network`). ``False`` on a hub-and-spoke
    #: engine, where every message would go through the server.
    runs_agents: bool = False

    def agent_network(self, program, adjacency, *, name: str = "agents", settings=None, previous=None):
        """The network that runs ``program`` (a
        :class:`~numpyro_fed.federation.decentralized.AgentProgram`) on the graph
        ``adjacency`` (``(N, N)``, concrete: the topology is static), one agent per client:
        in this process every agent ``vmap``-ped (:class:`~numpyro_fed.federation.InProcess`),
        or one worker per agent sending its messages to its neighbours' workers (an engine).
        ``previous``, a network this backend returned to the same sampler, is kept when it
        runs the same program (``settings`` equal, e.g. the sampler's ``repr``) on the same
        data, and is given the program when its agents loaded their own rows (see
        :meth:`agent_hosts`). A network has ``start(own) -> NetworkState``, ``local_struct()``
        and ``sampler_step(batched)`` (see :mod:`~numpyro_fed.federation.decentralized`).

        :raises TypeError: a backend that does not :attr:`runs_agents`."""
        raise self._no_agents()

    def agent_hosts(self, loader, adjacency, *, name: str = "agents", previous=None):
        """Deployment: the agents of a network, each loading its own block with
        ``loader(m)`` where it lives, before their program is known (set-up calls reach them
        through the network's ``ask``; :meth:`agent_network` gives them the program).

        :raises TypeError: a backend that does not :attr:`runs_agents`, or runs them in this
            process (whose clients' blocks are loaded by :meth:`start`)."""
        raise self._no_agents()

    def _no_agents(self):
        return TypeError(
            f"{type(self).__name__} cannot run decentralized agents: a decentralized algorithm's "
            "agents message their neighbours every iteration, and this backend's clients talk to "
            "the server only. Use InProcess() or RayFederation()"
        )

    # -- shared helpers --------------------------------------------------------------------
    def _function(self, name: str) -> Callable:
        try:
            return self.program.functions[name]
        except KeyError:
            raise KeyError(
                f"the client program has no function '{name}' (functions: {sorted(self.program.functions)})"
            ) from None

    def _stateful_function(self, name: str) -> Callable:
        try:
            return self.program.stateful[name]
        except KeyError:
            raise KeyError(
                f"the client program has no stateful function '{name}' (stateful: {sorted(self.program.stateful)})"
            ) from None

    def reply_shape(self, name: str, *args, client: int = 0):
        """``jax.eval_shape`` of ``functions[name]`` on client ``client``'s block spec: the
        shape of one client's reply (the server knows shapes, never values)."""
        return jax.eval_shape(self._function(name), self.block_specs[client], *args)

    def __repr__(self) -> str:
        state = f"num_clients={self.num_clients}" if self.started else "not started"
        return f"{type(self).__name__}({state}{self._loader_repr()})"

    def _loader_repr(self) -> str:
        if not self.deployed:
            return ""
        name = getattr(self.loader, "__name__", type(self.loader).__name__)
        return f", loader={name}" + ("" if self.started else f", num_clients={self.loader_num_clients}")
