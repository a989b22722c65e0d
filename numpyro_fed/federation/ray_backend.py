"""Clients as Ray actors: :class:`RayFederation` (``pip install numpyro_fed[ray]``).

One long-lived actor per client holds that client's block and its compiled functions, and
nothing else. Inside compiled code, :meth:`~RayFederation.map` and :meth:`~RayFederation.one`
are ``jax.pure_callback``\\ s (``vmap_method="expand_dims"``): under a ``vmap`` over chains a
single round trip carries every chain's request, and each actor ``vmap``\\ s its function over
the chains it received. A decentralized algorithm's agents are actors too
(:meth:`~RayFederation.agent_network`: a :class:`~numpyro_fed.federation.ray_agents.RayNetwork`),
sending their messages to their neighbours' actors directly.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import time
import uuid
import warnings

import numpy as np

import jax

from numpyro_fed.federation.base import ClientError, ClientProgram
from numpyro_fed.federation.ledger import MessageLedger
from numpyro_fed.federation.ray_agents import RayNetwork
from numpyro_fed.federation.ray_worker import ClientWorker, import_ray, state_folder, thread_limits
from numpyro_fed.federation.remote import RemoteFederation

__all__ = ["RayFederation"]


# -- the federation -----------------------------------------------------------------------------


#: calls whose arguments are smaller than this many bytes are pickled into one buffer (see
#: :meth:`ClientWorker.call_packed`); larger ones go through Ray's own serialization,
#: which puts large arrays in its object store without a copy
PACK_LIMIT = 1 << 16


@jax.tree_util.register_pytree_node_class
class RayFederation(RemoteFederation):
    """Each client a long-lived Ray actor holding only its own block.

    :param str address: the Ray cluster to join (``"auto"``, ``"ray://host:10001"``, ...);
        ``None`` joins the Ray already running in this process or starts a local one.
    :param float timeout: seconds to wait for a client's reply (and for the clients to start)
        before raising :class:`~numpyro_fed.federation.ClientError` naming it.
    :param int threads: compute threads per client actor (``None``: leave JAX's defaults);
        see :func:`~numpyro_fed.federation.ray_worker.thread_limits`.
    :param actor_options: Ray options of each client's actor: a dict, or a function
        ``m -> dict`` (e.g. ``lambda m: {"resources": {f"client{m}": 1}}`` pins client ``m``
        to the node started with that custom resource). Default ``{"num_cpus": 0,
        "scheduling_strategy": "SPREAD"}``: a client reserves no CPU (so ``M`` clients fit on
        a machine with fewer cores;
        :func:`~numpyro_fed.federation.ray_worker.thread_limits` keeps them from
        oversubscribing it) and the clients are spread over the cluster's nodes.
    :param float start_timeout: seconds to wait for the actors to start and load their blocks
        (a new process imports JAX: several seconds on a loaded machine).
    :param dict env_vars: more environment variables for the actors.
    :param dict init_kwargs: passed to ``ray.init`` when this federation starts Ray.
    :param loader: deployment: ``m -> client m's model arguments``, run on client ``m``'s
        actor; the driver never holds a row (see :class:`~numpyro_fed.federation.Federation`).
    :param int num_clients: ``M``, with ``loader``.
    :param str state_dir: where each worker saves its client state (see
        :class:`~numpyro_fed.federation.ClientState`) after every stateful call that changes
        it, on its own machine: ``<state_dir>/numpyro_fed_state/<federation id>/client<m>/``
        (an array is written once, however many calls leave it unchanged); default
        (``None``): the worker's temporary folder. A worker replaced by :meth:`restart`
        reloads it, so a run stopped by a dead worker resumes; :meth:`close` removes it.

    **Client state.** :meth:`init_state` sends each actor its slice of the initial state once;
    the stateful calls (``map``/``one`` with ``state=``) send the actor the version its state
    is at (transport bookkeeping, not counted in the ledger) with the call's arguments; the
    actor runs the function on its own state, keeps the new one and its previous one, and
    replies with the reply only. The driver never receives a client's state.

    :ivar int pack_limit: a call whose arguments are smaller than this many bytes (64 KiB)
        travels as one pickled buffer each way (Ray serializes every argument on its own,
        which costs more than a small call's arrays); larger calls go through Ray's own
        serialization (large arrays without a copy). ``0``: every call through Ray's.

    On a local Ray (``address=None``), the actors get the driver's ``sys.path`` as
    ``PYTHONPATH`` so that functions defined in the driver's modules unpickle on the workers;
    on a cluster, install the package and the modules of your functions on every node (or use
    Ray's ``runtime_env``).

    .. code-block:: python

        import numpyro_fed as nf
        with nf.RayFederation(timeout=30.0) as federation:
            sampler = nf.FedZigZag(model, federation=federation)
            ...
    """

    def __init__(
        self,
        address: str | None = None,
        timeout: float = 60.0,
        *,
        threads: int | None = 1,
        actor_options=None,
        env_vars: dict | None = None,
        init_kwargs: dict | None = None,
        start_timeout: float = 180.0,
        loader=None,
        num_clients: int | None = None,
        state_dir: str | None = None,
    ):
        super().__init__(loader=loader, num_clients=num_clients)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, not {timeout}")
        self.address = address
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.threads = threads
        self.actor_options = actor_options
        self.env_vars = dict(env_vars or {})
        self.init_kwargs = dict(init_kwargs or {})
        self._actors = []
        self._started_ray = False
        #: the :class:`~numpyro_fed.federation.ray_agents.RayNetwork` whose agents are this
        #: federation's actors (a decentralized sampler's), else ``None``
        self._network = None
        self.pack_limit = PACK_LIMIT
        self._dead = set()  # clients whose actor died (a partial call replaces it before its next call)
        self.state_dir = None if state_dir is None else os.fspath(state_dir)
        #: names the folder of this federation's saved client states
        self.federation_id = uuid.uuid4().hex

    # -- host side -------------------------------------------------------------------------
    def _ensure_ray(self):
        ray = import_ray()
        if not ray.is_initialized():
            kwargs = {"include_dashboard": False, "log_to_driver": False}
            if self.address is None:
                kwargs["num_cpus"] = max(os.cpu_count() or 1, 2)
            kwargs.update(self.init_kwargs)
            with warnings.catch_warnings():
                # Ray starts its processes with fork+exec, after JAX has started threads
                # (JAX warns of fork in a threaded process), and tips about a GPU setting.
                warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
                warnings.filterwarnings("ignore", ".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", FutureWarning)
                ray.init(address=self.address, **kwargs)
            self._started_ray = True
        return ray

    def _options(self, m):
        options = self.actor_options(m) if callable(self.actor_options) else dict(self.actor_options or {})
        options = dict(options)
        options.setdefault("num_cpus", 0)
        if "resources" not in options and "placement_group" not in options:
            options.setdefault("scheduling_strategy", "SPREAD")
        env = {"JAX_ENABLE_X64": str(bool(jax.config.jax_enable_x64))}
        if self.threads is not None:
            env.update(thread_limits(self.threads))
        if self.address is None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env.update(self.env_vars)
        runtime_env = dict(options.pop("runtime_env", {}) or {})
        runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
        options["runtime_env"] = runtime_env
        return options

    def _spawn(self, num_clients):
        """The client actors, created once and reused by later :meth:`start` and
        :meth:`describe` calls with the same number of clients.

        Calls run one at a time on an actor's main thread (a threaded actor costs a few
        milliseconds per call)."""
        if len(self._actors) == num_clients and self._network is None:
            return self._actors
        self._kill_actors()
        ray = self._ensure_ray()
        remote = ray.remote(ClientWorker)
        x64 = bool(jax.config.jax_enable_x64)
        self._actors = [
            remote.options(**self._options(m)).remote(m, x64, self.state_dir, self.federation_id)
            for m in range(num_clients)
        ]
        return self._actors

    def start(self, program: ClientProgram) -> "RayFederation":
        """Gives each client actor its program and block (or runs its loader there); the
        actors of an earlier :meth:`start` or :meth:`describe` with as many clients are
        reused. A ``ValueError`` naming the clients whose data was refused leaves the actors
        up: fix the data and start again, or :meth:`close`."""
        return super().start(program)

    def start_clients(self, program: ClientProgram) -> list:
        actors = self._spawn(program.num_clients)
        refs = {m: actor.load.remote(self._program_for(program, m)) for m, actor in enumerate(actors)}
        try:
            specs = self._gather("start", refs, refuse=True, timeout=self.start_timeout)
        except ValueError:
            raise
        except BaseException:
            self.close()
            raise
        return [
            jax.tree_util.tree_map(
                lambda s: jax.ShapeDtypeStruct(s[0], np.dtype(s[1])),
                specs[m],
                is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str),
            )
            for m in range(program.num_clients)
        ]

    def _program_for(self, program, m):
        if program.blocks is None:
            return program
        # only client m's block goes to worker m
        return ClientProgram(
            program.functions, blocks=[program.blocks[m]], spec=program.spec, stateful=program.stateful
        )

    def restart(self, clients=None) -> "RayFederation":
        """Replaces the actors of ``clients`` (default: those that do not answer a ping within
        the timeout, e.g. after a :class:`~numpyro_fed.federation.ClientError`) by new ones
        with the same program and block (re-loaded by the loader in deployment) and the
        client state their predecessors saved (see ``state_dir``), so that a run can be
        resumed from its last state. The ledger is kept."""
        ray = self._ensure_ray()
        program = self.program
        if clients is None:
            pings, clients = {}, []
            for m, actor in enumerate(self._actors):
                try:
                    pings[m] = actor.ping.remote()
                except Exception:  # gone: dead, or of a Ray that was shut down since (no call reaches it)
                    clients.append(m)
            ready = ray.wait(list(pings.values()), num_returns=len(pings), timeout=self.timeout)[0] if pings else []
            for m, ref in pings.items():
                try:
                    if ref not in ready:
                        raise TimeoutError
                    ray.get(ref, timeout=0)
                except Exception:
                    clients.append(m)
        clients = sorted(int(c) for c in clients)
        self._dead -= set(clients)
        remote = ray.remote(ClientWorker)
        x64 = bool(jax.config.jax_enable_x64)
        for m in clients:
            with contextlib.suppress(Exception):
                ray.kill(self._actors[m])
            self._actors[m] = remote.options(**self._options(m)).remote(m, x64, self.state_dir, self.federation_id)
        refs = {m: self._actors[m].load.remote(self._program_for(program, m)) for m in clients}
        if refs:
            self._gather("restart", refs, refuse=True, timeout=self.start_timeout)
        return self

    def rejoin(self, clients) -> set:
        """Before a ``partial`` call, of ``clients`` (whose last call failed): replaces the
        actors that died (:meth:`restart`: a new actor reloads the client's rows and the client
        state its predecessor saved, within ``start_timeout``) and returns the clients to send
        the call to; one that cannot be replaced stays out of this call."""
        dead = sorted(set(clients) & self._dead)
        if not dead:
            return set(clients)
        try:
            self.restart(dead)
        except ClientError:
            self._take_error()
            return set(clients) - set(dead)
        self._dead -= set(dead)
        return set(clients)

    def describe(self, loader, num_clients):
        """Runs ``loader(m)`` on client ``m``'s actor (started here if needed, and reused by
        :meth:`start`); returns the shapes, dtypes and scalar settings it loaded, never rows."""
        actors = self._spawn(int(num_clients))
        out = self._gather(
            "describe",
            {m: a.describe.remote(loader) for m, a in enumerate(actors)},
            refuse=True,
            timeout=self.start_timeout,
        )
        return [out[m] for m in range(int(num_clients))]

    def _kill_actors(self):
        self._network = None  # a decentralized network's agents are among the actors killed
        if not self._actors:
            return
        ray = import_ray()
        with contextlib.suppress(Exception):  # the live workers remove their saved states
            ray.wait(
                [a.clear_state.remote() for a in self._actors],
                num_returns=len(self._actors),
                timeout=min(self.timeout, 10.0),
            )
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors = []
        self._state_struct = None
        if self.address is None:  # a local Ray: the workers' folder is on this machine
            shutil.rmtree(state_folder(self.state_dir, self.federation_id), ignore_errors=True)

    def close(self) -> None:
        """Ends the client actors (and the local Ray this federation started)."""
        self._kill_actors()
        self._program = None
        if self._started_ray:
            import_ray().shutdown()
            self._started_ray = False

    @property
    def actors(self) -> list:
        """The client actors, one per client (for monitoring and fault tests)."""
        return list(self._actors)

    def _gather(self, call, refs, *, refuse=False, timeout=None):
        """Waits for ``{client: ref}``; a :class:`ClientError` naming the silent, dead or
        failing clients (a ``ValueError`` for data refused at ``setup``)."""
        ray = import_ray()
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        timeout = self.timeout if timeout is None else timeout
        clients = list(refs)
        pending = [refs[c] for c in clients]
        start = time.monotonic()
        try:  # the common case, in one call
            return dict(zip(clients, ray.get(pending, timeout=timeout)))
        except (GetTimeoutError, RayActorError, RayTaskError):
            pass
        left = max(timeout - (time.monotonic() - start), 0.0)
        ready, not_ready = ray.wait(pending, num_returns=len(pending), timeout=left)
        results, failures, refused = {}, [], []
        for c in clients:
            ref = refs[c]
            if ref in not_ready:
                continue
            try:
                results[c] = ray.get(ref, timeout=timeout)
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if refuse and isinstance(cause, (ValueError, TypeError)):
                    refused.append(str(cause))
                    continue
                failures.append((c, f"failed: {type(cause).__name__ if cause else 'error'}: {cause or exc}"))
            except RayActorError as exc:
                failures.append((c, f"died ({type(exc).__name__})"))
                self._dead.add(c)
            except GetTimeoutError:
                not_ready.append(ref)
        if refused:
            raise ValueError("; ".join(refused))
        silent = [c for c in clients if refs[c] in not_ready]
        if failures or silent:
            parts = [f"client {c} {why}" for c, why in failures]
            if silent:
                parts.append(f"client(s) {silent} did not answer within {timeout} s")
            error = ClientError(
                f"call '{call}': " + "; ".join(parts),
                clients=[c for c, _ in failures] + silent,
                call=call,
                replies=results,
            )
            self._error = error
            raise error
        return results

    def _submit(self, m, name, args, in_axes, nbytes, version=None):
        """Client ``m``'s call, sent as one pickled buffer when it is small."""
        actor = self._actors[m]
        if nbytes < self.pack_limit:
            return actor.call_packed.remote(
                pickle.dumps((name, args, in_axes, version), protocol=pickle.HIGHEST_PROTOCOL)
            )
        return actor.call.remote(name, args, in_axes, version)

    def _replies(self, call, refs):
        """:meth:`_gather`, with packed replies unpickled (those a :class:`ClientError`
        carries too: the clients that answered a call another failed)."""

        def unpack(replies):
            return {m: pickle.loads(r) if isinstance(r, bytes) else r for m, r in replies.items()}

        try:
            return unpack(self._gather(call, refs, timeout=self.call_timeout(call, self.timeout)))
        except ClientError as error:
            error.replies = unpack(error.replies)
            raise

    def compute_time(self) -> list:
        """Per client, ``{name: (calls, seconds)}``: the calls it answered since it started and
        the time it spent computing them (its function, not Ray): with the ledger's round
        trips, what a round costs on the clients and what it costs in transport."""
        ray = import_ray()
        return ray.get([a.compute_time.remote() for a in self._actors], timeout=self.timeout)

    # -- transport hooks (see RemoteFederation) ------------------------------------------------
    def send_calls(self, name, calls):
        refs = {
            m: self._submit(m, name, call.args, call.in_axes, call.nbytes, version=call.version)
            for m, call in calls.items()
        }
        return self._replies(name, refs)  # a stateful call's worker answers (reply, its new version)

    send_stateful_calls = send_calls

    def send_initial_state(self, slices):
        self._gather("init_state", {m: self._actors[m].set_state.remote(value) for m, value in slices.items()})

    # -- decentralized agents: the actors are the agents of a RayNetwork ------------------------
    runs_agents = True

    def agent_network(self, program, adjacency, *, name="agents", settings=None, previous=None) -> RayNetwork:
        """A :class:`~numpyro_fed.federation.ray_agents.RayNetwork` of ``program``'s agents, this
        federation's actors (they replace the actors of another algorithm's run). ``previous``,
        the network this federation gave the same sampler, is kept if its agents hold the same
        data and ``settings`` are the same (else the federation is closed and started anew),
        and is given ``program`` if its agents loaded their own rows (:meth:`agent_hosts`)."""
        if previous is not None and previous is self._network and self.started:
            if previous.deployed:
                previous.install(program, settings)
                return previous
            if previous.same(program, adjacency, settings):
                previous.program = program
                return previous
            self.close()
        network = RayNetwork(self, program, adjacency, name=name)
        network.settings = settings
        return network

    def agent_hosts(self, loader, adjacency, *, name="agents", previous=None) -> RayNetwork:
        """Deployment: a :class:`~numpyro_fed.federation.ray_agents.RayNetwork` whose agents
        load their own blocks with ``loader`` on their actors; ``previous``, the network this
        federation gave the same sampler on the same graph, is kept (its agents keep their
        blocks)."""
        if (
            previous is not None
            and previous is self._network
            and self.started
            and previous.deployed
            and np.array_equal(np.asarray(adjacency) != 0, previous.adjacency)
        ):
            return previous
        return RayNetwork(self, None, adjacency, name=name, loader=loader)

    def host_agents(self, network: RayNetwork, program: ClientProgram, spawn) -> list:
        """Makes ``network``'s agents this federation's actors, so that :meth:`close`,
        :attr:`actors`, :attr:`ledger` and :meth:`guard` apply to them: ends the actors it has,
        takes ``program`` (what the agents hold, for :attr:`program`) and a new ledger, and
        starts agent ``m``'s actor with ``spawn(m, options)`` (``options``: its Ray options).
        Returns the actors."""
        self._ensure_ray()
        self._kill_actors()
        self._program = program
        self._ledger = MessageLedger(program.num_clients)
        self._specs = [None] * program.num_clients
        self._actors = [spawn(m, self._options(m)) for m in range(program.num_clients)]
        self._network = network
        return list(self._actors)

    def replace_agent(self, m: int, spawn):
        """Ends agent ``m``'s actor and starts a new one with ``spawn(m, options)``; returns it."""
        ray = self._ensure_ray()
        with contextlib.suppress(Exception):
            ray.kill(self._actors[m])
        self._actors[m] = spawn(m, self._options(m))
        return self._actors[m]

    def set_block_specs(self, specs) -> None:
        """Deployment: the ``ShapeDtypeStruct`` trees of the blocks the agents loaded."""
        self._specs = list(specs)

    def gather(self, call: str, refs: dict, *, refuse: bool = False, timeout: float | None = None) -> dict:
        """Waits for ``{client: Ray object ref}`` and returns ``{client: value}``; raises a
        :class:`~numpyro_fed.federation.ClientError` naming the silent, dead or failing clients
        (kept for :meth:`guard`), or with ``refuse`` a ``ValueError`` for refused data."""
        return self._gather(call, refs, refuse=refuse, timeout=timeout)

    def keep_error(self, error: ClientError) -> None:
        """Keeps ``error``, raised inside compiled code, for :meth:`guard` to re-raise as itself."""
        self._error = error

    def __repr__(self) -> str:
        where = "local" if self.address is None else repr(self.address)
        state = f"num_clients={self.num_clients}" if self._program is not None else "not started"
        return f"RayFederation({where}, {state}, timeout={self.timeout}{self._loader_repr()})"
