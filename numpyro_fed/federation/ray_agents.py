"""Decentralized agents as Ray actors: :class:`RayNetwork` (see
:mod:`numpyro_fed.federation.decentralized` for the agents' program).

Each agent is an actor of a :class:`~numpyro_fed.federation.RayFederation` holding its own
data, its compiled functions and the handles of its neighbours' actors; it runs its own loop
of iterations and sends its message to its neighbours' actors directly. The driver starts
the loops and collects each agent's state per iteration; it never relays a message.
"""

from __future__ import annotations

import time

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.federation.agent_worker import AgentWorker
from numpyro_fed.federation.base import (
    ClientProgram,
    NetworkError,
    tree_nbytes,
)
from numpyro_fed.federation.decentralized import (
    AgentProgram,
    NetworkState,
    attached_struct,
    deliver,
    neighbors,
    start_network,
)
from numpyro_fed.federation.decentralized import (
    info_struct as info_struct_of,
)

__all__ = ["RayNetwork"]


class RayNetwork:
    """``program``'s agents as the actors of a :class:`~numpyro_fed.federation.RayFederation`,
    exchanging their messages actor to actor.

    Made by :meth:`RayFederation.agent_network <numpyro_fed.federation.RayFederation.agent_network>`
    (and :meth:`~numpyro_fed.federation.RayFederation.agent_hosts` in deployment).

    The driver starts the agents' loops in chunks of iterations (``chunk`` doubles from 4 up to
    ``max_chunk``) and collects every agent's state and diagnostics per iteration; it hands them
    out one iteration at a time to the compiled sampler (:meth:`sampler_step`). A request
    for an iteration that does not follow the last one handed out (a new chain, a resumed
    run) restarts the network from the given states: each agent gets its own state only and
    the agents exchange their messages before the first iteration. A dead agent's actor is
    replaced at a restart.

    The federation's ledger counts, per agent: ``"<name>/iterate"`` to peers (each message and
    its bytes, as sent), ``"<name>/start"`` to peers (the exchange that starts a network),
    ``"<name>/state"`` to the agent (its own state at a start) and from it (its state and
    diagnostics per iteration: what the driver collects).
    """

    def __init__(
        self,
        federation,
        program: AgentProgram | None,
        adjacency,
        *,
        name: str = "agents",
        max_chunk: int = 64,
        loader=None,
    ):

        self.federation = federation
        self.program = program
        self.adjacency = np.asarray(adjacency) != 0
        self.num_agents = n = self.adjacency.shape[0]
        self.name = name
        self.settings = None
        self.max_chunk = int(max_chunk)
        #: deployment: ``m -> agent m's block``, run on agent ``m``'s actor (else ``None``)
        self.loader = loader
        if (program is None) != (loader is not None):
            raise ValueError(
                "RayNetwork takes a program (simulation) or a loader (deployment; install() gives the program later)"
            )
        self.locals = None
        if program is not None:
            self.locals = [jax.tree_util.tree_map(lambda a, m=m: np.asarray(a[m]), program.local) for m in range(n)]
        self._remote = None
        # the workers of another algorithm's run, or those that described the clients' data,
        # make way for the agents (a later run of a server-based algorithm replaces them in turn);
        # the federation's actors are the agents: its close(), actors, ledger and guard() apply
        if loader is None:
            hosted = ClientProgram({}, blocks=self.locals)
        else:
            hosted = ClientProgram({}, loader=loader, num_clients=n)
        actors = federation.host_agents(self, hosted, self._new_actor)
        try:
            specs = federation.gather(
                "setup",
                {m: a.setup.remote() for m, a in enumerate(actors)},
                refuse=True,
                timeout=federation.start_timeout,
            )
            self._connect()
        except BaseException:
            federation.close()
            raise
        #: deployment: the ``ShapeDtypeStruct`` tree of agent ``m``'s block (what it reported)
        self.block_specs = None
        if loader is not None:
            self.block_specs = [
                jax.tree_util.tree_map(
                    lambda s: jax.ShapeDtypeStruct(s[0], np.dtype(s[1])),
                    specs[m],
                    is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str),
                )
                for m in range(n)
            ]
            federation.set_block_specs(self.block_specs)
        self.run_id = 0
        self.buffer = []  # collected iterations not yet handed out: (own, info, messages, bytes)
        self.expected = None  # (i, own, keys) of the last iteration handed out
        self.chunk = 4
        self.handed = []  # every iteration handed out since the last (re)start: (i, own, info)
        self.restarts = 0
        self._sent = None
        #: ``(resume, history) -> (state, draws)``: what a :class:`NetworkError` reports (set by
        #: the sampler's face)
        self.describe = None

    def same(self, program, adjacency, settings) -> bool:
        """Whether this network's agents hold ``program``'s data on ``adjacency``."""
        if settings != self.settings or not np.array_equal(np.asarray(adjacency) != 0, self.adjacency):
            return False
        leaves = jax.tree_util.tree_leaves(program.local)
        mine = jax.tree_util.tree_leaves(self.program.local)
        return len(leaves) == len(mine) and all(
            np.shape(a) == np.shape(b) and np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves, mine)
        )

    # -- deployment ------------------------------------------------------------------------
    @property
    def deployed(self) -> bool:
        """Whether the agents loaded their own blocks (the driver holds none)."""
        return self.loader is not None

    def block_struct(self):
        """Deployment: the agents' blocks' ``ShapeDtypeStruct`` tree, stacked on a leading
        agent axis (the blocks are padded to a common shape)."""
        specs = self.block_specs
        for m, spec in enumerate(specs[1:], 1):
            if spec != specs[0]:
                raise ValueError(
                    f"agent {m}'s block has shapes {spec}, agent 0's {specs[0]}: the "
                    "agents' blocks must have a common shape (rows padded and masked)"
                )
        return jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct((self.num_agents,) + tuple(s.shape), s.dtype), specs[0]
        )

    def ask(self, name, fn, *broadcast, per_agent=()):
        """``(N, ...)``: every agent's ``fn(block, *broadcast, *own)`` (``own``: its row of each
        ``per_agent`` array), computed on its actor: a set-up or diagnostic call, counted in
        the ledger as ``"<name>/<call>"``. ``fn`` must be picklable and hold no rows."""
        actors = self.federation.actors
        ledger = self.federation.ledger
        broadcast = jax.tree_util.tree_map(np.asarray, tuple(broadcast))
        per_agent = jax.tree_util.tree_map(np.asarray, tuple(per_agent))
        digest = _function_digest(fn)
        refs = {}
        for m, actor in enumerate(actors):
            own = jax.tree_util.tree_map(lambda a, m=m: a[m], per_agent)
            refs[m] = actor.ask.remote(fn, broadcast + own, digest)
            ledger.add(
                f"{self.name}/{name}",
                "to_client",
                m,
                messages=1,
                nbytes=tree_nbytes(broadcast) + tree_nbytes(own),
                rounds=1,
            )
        replies = self.federation.gather(f"{self.name}/{name}", refs)
        for m in range(self.num_agents):
            ledger.add(f"{self.name}/{name}", "from_client", m, messages=1, nbytes=tree_nbytes(replies[m]))
        ledger.round_trips += 1
        return jax.tree_util.tree_map(
            lambda *a: jnp.asarray(np.stack(a)), *[replies[m] for m in range(self.num_agents)]
        )

    def agent_ask(self, prior_weights):
        """:attr:`~numpyro_fed.infer.admm.AgentPotentials.ask`: ``(name, fn, *broadcast) ->``
        every agent's ``fn(block, prior_weight, *broadcast)``, agent ``m`` with its
        ``prior_weights[m]``."""
        weights = np.asarray(prior_weights)

        def ask(name, fn, *broadcast):
            return self.ask(name, _WithPriorWeight(fn), *broadcast, per_agent=(weights,))

        return ask

    def install(self, program: AgentProgram, settings=None):
        """Deployment: gives every agent its program (``program.local`` sliced: agent ``m``
        gets its row of what the driver knows; ``program.attach`` joins it to the block the
        agent loaded). A program equal to the installed one is not sent again."""
        n = self.num_agents
        locals_ = [jax.tree_util.tree_map(lambda a, m=m: np.asarray(a[m]), program.local) for m in range(n)]
        if (
            self.program is not None
            and settings is not None
            and settings == self.settings
            and _same_leaves(locals_, self.locals)
        ):
            self.program = program
            return
        self.program, self.locals, self.settings = program, locals_, settings
        refs = {m: a.install.remote(program._replace(local=locals_[m])) for m, a in enumerate(self.federation.actors)}
        self.federation.gather("install", refs, refuse=True, timeout=self.federation.start_timeout)
        self.expected, self.buffer, self.handed = None, [], []  # the next iteration restarts the network

    # -- actors ----------------------------------------------------------------------------
    def _new_actor(self, m, options):
        """Agent ``m``'s actor, with the federation's Ray ``options`` for it."""
        if self._remote is None:
            import ray

            # the loop runs on the actor's main thread; deliver() and abort() in their own group,
            # so that the neighbours' messages arrive while the loop waits for them
            self._remote = ray.remote(concurrency_groups={"inbox": 2})(AgentWorker)
        agent_program = None
        if self.program is not None:
            agent_program = self.program._replace(local=self.locals[m])  # agent m's data only
        index, valid = neighbors(self.adjacency)
        return self._remote.options(**options).remote(
            m, agent_program, index[m][valid[m]], valid[m], bool(jax.config.jax_enable_x64), self.loader
        )

    def _connect(self):
        actors = self.federation.actors
        refs = {
            m: actors[m].connect.remote({int(k): actors[int(k)] for k in np.flatnonzero(self.adjacency[m])})
            for m in range(self.num_agents)
        }
        self.federation.gather("connect", refs)

    def _revive(self):
        """Replaces dead actors (a restart after a fault)."""
        import ray

        refs = [a.ping.remote() for a in self.federation.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.federation.timeout)
        dead = []
        for m, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0) if ref in ready else (_ for _ in ()).throw(TimeoutError())
            except Exception:
                dead.append(m)
        if not dead:
            return
        replaced = {m: self.federation.replace_agent(m, self._new_actor) for m in dead}
        self.federation.gather(
            "setup",
            {m: actor.setup.remote() for m, actor in replaced.items()},
            refuse=True,
            timeout=self.federation.start_timeout,
        )
        self._connect()

    # -- running ---------------------------------------------------------------------------
    def _run(self, t0, num_iterations, own=None, keys=None):
        """One chunk on every actor; returns per agent ``(own, info, messages, bytes)`` stacked
        over the chunk's iterations, or raises :class:`ClientError`."""

        import ray
        from ray.exceptions import RayActorError, RayTaskError

        actors, timeout = self.federation.actors, self.federation.timeout
        ledger = self.federation.ledger
        refs = {}
        for m, actor in enumerate(actors):
            own_m = keys_m = None
            if own is not None:
                own_m = jax.tree_util.tree_map(lambda a, m=m: np.ascontiguousarray(a[:, m]), own)
                keys_m = keys
                ledger.add(
                    f"{self.name}/state",
                    "to_client",
                    m,
                    messages=keys.shape[0],
                    nbytes=tree_nbytes(own_m) + tree_nbytes(keys_m),
                )
            refs[m] = actor.run.remote(self.run_id, t0, num_iterations, own_m, keys_m, timeout)
        # a generous deadline for the whole chunk: each iteration waits at most `timeout` for a neighbour
        deadline = timeout * (num_iterations + 2)
        pending = list(refs.values())
        results, dead, silent, failed = {}, [], set(), []

        start = time.monotonic()
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - (time.monotonic() - start), 0))
            if not ready:
                break
            (ref,) = ready
            m = next(k for k, r in refs.items() if r == ref)
            try:
                results[m] = ray.get(ref)
            except RayActorError:
                dead.append(m)
            except RayTaskError as exc:
                failed.append((m, exc))
            else:
                if results[m][0] == "timeout":
                    silent.update(int(k) for k in results[m][1])
            if dead or failed or silent:
                for k, actor in enumerate(actors):  # stop the others' loops: the network is broken
                    if k not in results:
                        actor.abort.options(concurrency_group="inbox").remote(self.run_id)
        not_answered = [
            m for m, r in refs.items() if m not in results and m not in dead and m not in [f for f, _ in failed]
        ]
        if not (dead or failed or silent) and not_answered:
            silent.update(not_answered)
        if dead or failed or silent:
            self.run_id += 1
            parts = [f"agent {m} died" for m in dead]
            parts += [f"agent {m} failed: {exc}" for m, exc in failed]
            quiet = sorted(silent - set(dead))
            if quiet:
                parts.append(f"agent(s) {quiet} sent nothing within {timeout} s")
            culprits = list(dict.fromkeys(dead + [m for m, _ in failed] + quiet))
            raise NetworkError(
                f"{self.name}: " + "; ".join(parts) + f" (in the iterations after {t0}; "
                f"the run is resumable from iteration {t0}: see NetworkError)",
                clients=culprits,
                call=f"{self.name}/iterate",
            )
        for m in range(self.num_agents):
            _, _, _, messages, nbytes = results[m]
            chains = keys.shape[0] if keys is not None else self._chains
            if own is not None:
                degree = int(self.adjacency[m].sum())
                ledger.add(
                    f"{self.name}/start",
                    "to_peer",
                    m,
                    messages=degree * chains,
                    nbytes=int(nbytes[0]) * chains if len(nbytes) else 0,
                    rounds=1,
                )
            ledger.add(
                f"{self.name}/iterate",
                "to_peer",
                m,
                messages=int(messages.sum()) * chains,
                nbytes=int(nbytes.sum()) * chains,
                rounds=num_iterations,
            )
            ledger.add(
                f"{self.name}/state",
                "from_client",
                m,
                messages=num_iterations * chains,
                nbytes=tree_nbytes(results[m][1]) + tree_nbytes(results[m][2]),
            )
        ledger.round_trips += 1
        return [results[m][1:] for m in range(self.num_agents)]

    def advance(self, i, own, keys, sent):
        """Iteration ``i + 1`` of every chain (leading axis ``C``; ``own`` ``(C, N, ...)``): the
        agents' own states and diagnostics, and ``sent`` plus what they sent."""
        i = int(np.asarray(i).reshape(-1)[0])
        keys = np.asarray(keys)
        own = jax.tree_util.tree_map(np.asarray, own)
        self._chains = keys.shape[0]
        follows = (
            self.expected is not None
            and self.expected[0] == i
            and np.array_equal(self.expected[2], keys)
            and all(
                np.array_equal(a, b)
                for a, b in zip(jax.tree_util.tree_leaves(self.expected[1]), jax.tree_util.tree_leaves(own))
            )
        )
        self._sent = np.asarray(sent)
        if not follows:  # a new chain, or a resumed run: restart the network from these states
            self.buffer, self.handed, self.chunk = [], [], 4
            self.run_id += 1
            if self.restarts:
                self._revive()
            self.restarts += 1
            self.expected = (i, own, keys)
            self._fill(i, own, keys)
        elif not self.buffer:
            self._fill(i)
        own_next, info, messages, nbytes = self.buffer.pop(0)
        self.expected = (i + 1, own_next, keys)
        self.handed.append((i + 1, own_next, info))
        sent = np.asarray(sent).copy()
        sent[:, 0] += messages[None]
        sent[:, 1] += nbytes[None]
        self._sent = sent
        return own_next, info, sent

    def _fill(self, i, own=None, keys=None):
        try:
            per_agent = self._run(i, self.chunk, own, keys)
        except NetworkError as error:
            # what was computed so far: the last iteration handed out (resumable from there) and
            # every iteration handed out since the network started
            last = self.expected
            error.iteration = last[0]
            error.resume = dict(i=last[0], own=last[1], keys=last[2], sent=self._sent)
            error.history = list(self.handed)
            error.describe = self.describe
            self.expected = None
            self.federation.keep_error(error)
            raise
        self.chunk = min(2 * self.chunk, self.max_chunk)
        for k in range(len(per_agent[0][2])):
            own_k = jax.tree_util.tree_map(
                lambda *a: np.stack(a, axis=1), *[jax.tree_util.tree_map(lambda v: v[k], r[0]) for r in per_agent]
            )
            info_k = jax.tree_util.tree_map(
                lambda *a: np.stack(a, axis=1), *[jax.tree_util.tree_map(lambda v: v[k], r[1]) for r in per_agent]
            )
            messages = np.asarray([r[2][k] for r in per_agent])
            nbytes = np.asarray([r[3][k] for r in per_agent])
            self.buffer.append((own_k, info_k, messages, nbytes))

    def local_struct(self):
        """The ``ShapeDtypeStruct`` tree of the agents' stacked locals (in deployment, from the
        shapes the agents reported)."""
        if self.deployed:
            return attached_struct(self.program, self.block_struct())
        return attached_struct(self.program, None)

    def start(self, own) -> NetworkState:
        """The network at the agents' own states, as the sampler sees it (its first iteration
        restarts the agents' loops there: see :meth:`advance`)."""
        return start_network(self.program, self.adjacency, own)

    def sampler_step(self, batched: bool):
        """``step(rng_key, i, state, sent) -> (state, info, sent)`` (see
        :mod:`~numpyro_fed.federation.decentralized`): the next iteration as a host callback
        inside the compiled sampler (every argument with a leading chain axis if ``batched``)."""
        from jax.experimental import io_callback

        def step(rng_key, i, state, sent):
            own, keys = state.own, rng_key
            if not batched:
                own, i, keys, sent = jax.tree_util.tree_map(lambda a: a[None], (own, i, keys, sent))
            chains = jnp.shape(i)[0]
            sent_array = jnp.stack([sent.messages, sent.bytes], axis=1)
            one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), own)
            first = jax.eval_shape(lambda o: NetworkState(o, deliver(self.adjacency, o.x)), one)
            info_struct = info_struct_of(self.program, self.adjacency, self.local_struct(), first)
            struct = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # noqa: E731
            out = (
                jax.tree_util.tree_map(struct, own),
                jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((chains,) + s.shape, s.dtype), info_struct),
                struct(sent_array),
            )
            own, info, sent_array = io_callback(self.advance, out, i, own, keys, sent_array, ordered=True)
            sent = sent._replace(messages=sent_array[:, 0], bytes=sent_array[:, 1])
            state = NetworkState(own, jax.vmap(lambda x: deliver(self.adjacency, x))(own.x))
            if not batched:
                state, info, sent = jax.tree_util.tree_map(lambda a: a[0], (state, info, sent))
            return state, info, sent

        return step


def _function_digest(fn) -> str:
    """A hash of ``fn``'s pickled form: the same set-up function asked again has the same
    digest, so its agents reuse what they compiled for it."""
    import hashlib

    from ray import cloudpickle

    return hashlib.sha256(cloudpickle.dumps(fn)).hexdigest()


class _WithPriorWeight:
    """``(block, *broadcast, prior_weight) -> fn(block, prior_weight, *broadcast)`` (picklable)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, block, *args):
        return self.fn(block, args[-1], *args[:-1])


def _same_leaves(a, b) -> bool:
    if b is None:
        return False
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.shape(x) == np.shape(y) and np.array_equal(x, y) for x, y in zip(la, lb))
