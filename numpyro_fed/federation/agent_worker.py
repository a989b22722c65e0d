"""One decentralized agent on its own Ray actor: :class:`AgentWorker`, what
:class:`~numpyro_fed.federation.ray_agents.RayNetwork` starts for every agent.

The worker holds its agent's data and compiled functions and the handles of its neighbours'
workers; it runs its own loop of iterations, sends its message to its neighbours directly
and waits (up to a timeout) for theirs.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.federation.base import (
    block_spec,
    check_block,
    describe_arguments,
)

__all__ = ["AgentWorker"]


class AgentWorker:
    """Agent ``m``'s actor: its slice of ``local``, its compiled functions, its neighbours'
    handles and its inbox. ``run`` is its loop of iterations; ``deliver`` (called by its
    neighbours' actors) fills the inbox while the loop waits."""

    def __init__(self, agent, program, neighbours, mask, x64, loader=None):

        jax.config.update("jax_enable_x64", bool(x64))
        self.agent = int(agent)
        self.program = program
        self.loader = loader  # deployment: this agent loads its own block here
        self.block = None
        self.mask = np.asarray(mask, dtype=bool)
        self.senders = [int(k) for k in neighbours]  # in the order of the inbox's rows
        self.receivers = {}
        self.mailbox = defaultdict(dict)  # (run, round) -> {sender: message}
        self.ready = threading.Condition()
        self.aborted = set()
        self.delivered = defaultdict(int)  # sender -> messages delivered to this agent
        self.run_id = None
        self.t = None
        self.own = self.inbox = self.keys = None
        self.fns = None
        self.asked = {}  # digest of a set-up function -> its compiled form, kept between calls

    def setup(self):
        """Checks the agent's data (finite values) and compiles nothing yet. In deployment,
        first loads the agent's block with the loader (here, never on the driver) and
        reports its shapes and dtypes only."""
        if self.loader is not None:
            block = self.loader(self.agent)
            check_block(block, self.agent)
            self.block = jax.tree_util.tree_map(jnp.asarray, block)
            if self.program is not None:
                self.install(self.program)
            return jax.tree_util.tree_map(lambda s: (tuple(s.shape), np.dtype(s.dtype).str), block_spec(block))
        check_block(self.program.local, self.agent)
        self.local = jax.tree_util.tree_map(jnp.asarray, self.program.local)
        return self.agent

    def install(self, program):
        """Deployment: the agent's program; its local is ``program.attach(block, local)``
        (``program.local``: this agent's share of what the driver knows)."""
        self.program, self.fns = program, None
        local = program.local
        if program.attach is not None:
            local = program.attach(self.block, local)
        self.local = jax.tree_util.tree_map(jnp.asarray, local)
        return self.agent

    def ask(self, fn, args, digest=None):
        """A set-up or diagnostic call: ``fn(block, *args)`` on this agent's block. ``digest``
        names ``fn`` (a hash of its pickled form): the function arrives as a new object with
        every call, so it is compiled once per digest and reused (a Newton search asks the
        same function every round)."""
        if digest is None:
            compiled = jax.jit(fn)
        else:
            compiled = self.asked.get(digest)
            if compiled is None:
                compiled = self.asked[digest] = jax.jit(fn)
        return jax.tree_util.tree_map(np.asarray, compiled(self.block, *args))

    def describe(self, loader):
        """Runs the user's loader here; reports shapes, dtypes and scalar settings only (as
        a federation's client worker does, for a later run on the same actors)."""
        return describe_arguments(loader(self.agent))

    def ping(self):
        return self.agent

    def connect(self, receivers):
        """Handles of the actors this agent sends to (its neighbours)."""
        self.receivers = dict(receivers)
        return self.agent

    def deliveries(self):
        """``{sender: number of messages}`` delivered to this agent so far (for audits)."""
        return dict(self.delivered)

    def deliver(self, run, round_, sender, message):
        with self.ready:
            self.delivered[int(sender)] += 1
            if run in self.aborted:
                return
            self.mailbox[(run, round_)][sender] = message
            self.ready.notify_all()

    def abort(self, run):
        with self.ready:
            self.aborted.add(run)
            self.ready.notify_all()

    def _compile(self):
        program, agent = self.program, self.agent
        chains = lambda fn, axes: jax.jit(jax.vmap(fn, in_axes=axes))  # noqa: E731
        send = jax.vmap(program.send, in_axes=(None, 0, 0, 0, None))
        key_of = jax.vmap(lambda key, t: jax.random.fold_in(jax.random.fold_in(key, agent), t), in_axes=(0, None))
        self.fns = dict(
            message=chains(program.message, (0,)),
            # agent m's keys of iteration t (one per chain), then its send: one compiled call
            send=jax.jit(lambda local, keys, t, own, inbox, mask: send(local, key_of(keys, t), own, inbox, mask)),
            receive=chains(program.receive, (None, 0, 0, 0, None)),
        )

    def _exchange(self, run, round_, message, timeout):
        """Sends ``message`` to every neighbour and returns the inbox ``(C, N, ...)`` of their
        messages of this round, or ``None`` if the run was aborted; raises ``TimeoutError``."""

        for handle in self.receivers.values():
            handle.deliver.options(concurrency_group="inbox").remote(run, round_, self.agent, message)
        deadline = time.monotonic() + timeout
        with self.ready:
            while len(self.mailbox[(run, round_)]) < len(self.senders):
                if run in self.aborted:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(self.senders) - set(self.mailbox[(run, round_)]))
                    self.mailbox.pop((run, round_), None)
                    raise TimeoutError(missing, round_)
                self.ready.wait(left)
            received = self.mailbox.pop((run, round_))
        inbox = np.zeros((message.shape[0], self.mask.shape[0]) + message.shape[1:], message.dtype)
        for row, k in enumerate(self.senders):
            inbox[:, row] = received[k]
        return inbox

    def run(self, run, t0, num_iterations, own, keys, timeout):
        """Iterations ``t0 .. t0 + num_iterations - 1`` of every chain of this agent. With
        ``own`` (and ``keys``, one per chain), the network (re)starts there: a first round
        exchanges ``message(own)``. Returns ``("ok", own_trajectory, info_trajectory,
        messages, bytes)`` (per iteration, stacked), ``("timeout", missing, t)`` or
        ``("aborted",)``."""
        if self.fns is None:
            self._compile()
        fns, mask = self.fns, self.mask
        if own is not None:
            self.run_id, self.t, self.keys = run, t0, np.asarray(keys)
            self.own = jax.tree_util.tree_map(np.asarray, own)
            try:
                inbox = self._exchange(run, ("start", t0), np.asarray(fns["message"](self.own)), timeout)
            except TimeoutError as exc:
                return ("timeout",) + exc.args
            if inbox is None:
                return ("aborted",)
            self.inbox = inbox
        elif run != self.run_id or t0 != self.t:
            raise RuntimeError(
                f"agent {self.agent}: asked to continue run {run} at iteration {t0}, "
                f"but it is at run {self.run_id}, iteration {self.t}"
            )
        owns, infos, sent_messages, sent_bytes = [], [], [], []
        for t in range(t0, t0 + num_iterations):
            pending, message = fns["send"](self.local, self.keys, np.uint32(t), self.own, self.inbox, mask)
            message = np.asarray(message)
            try:
                inbox = self._exchange(run, t, message, timeout)
            except TimeoutError as exc:
                return ("timeout",) + exc.args
            if inbox is None:
                return ("aborted",)
            own, info = fns["receive"](self.local, pending, inbox, self.inbox, mask)
            self.own = jax.tree_util.tree_map(np.asarray, own)
            self.inbox, self.t = inbox, t + 1
            owns.append(self.own)
            infos.append(jax.tree_util.tree_map(np.asarray, info))
            # one message per neighbour and chain; its bytes: one chain's share of the array
            sent_messages.append(len(self.receivers))
            sent_bytes.append(len(self.receivers) * message.nbytes // message.shape[0])
        stack = lambda trees: jax.tree_util.tree_map(lambda *a: np.stack(a), *trees)  # noqa: E731
        return ("ok", stack(owns), stack(infos), np.asarray(sent_messages), np.asarray(sent_bytes))
