"""The federation seam: what a server may ask of its clients, and the backends that carry it.

An algorithm's core is written once against :class:`Federation` and runs on every backend:

* :class:`InProcess` (the default): every client in this process, ``vmap``-ed, compiled into
  the caller's ``jit``;
* :class:`RayFederation`: one long-lived Ray actor per client, holding only that client's
  block and its compiled functions (``pip install numpyro_fed[ray]``).

Engine backends (Ray, and :class:`~numpyro_fed.flower.FlowerFederation`) derive from
:class:`~numpyro_fed.federation.remote.RemoteFederation`, which owns the traceable calls and
leaves them only the transport (four hooks: see :mod:`numpyro_fed.federation.remote`).

The pieces:

* :class:`ClientProgram`: named pure functions ``f(block, *args)`` every client runs (and
  ``stateful`` ones of its own state, ``f(block, state, *args) -> (new_state, reply)``), and the
  clients' rows, either ``blocks`` (simulation: worker ``m`` receives ``blocks[m]`` only) or a
  ``loader`` (deployment: ``loader(m)`` runs on worker ``m``; the driver never holds rows).
* :meth:`Federation.start` / :meth:`Federation.close` (or ``with``) on the host.
* Traceable calls, usable inside ``jax.jit``, ``lax.while_loop`` and ``vmap`` over chains:

  - ``federation.map(name, *broadcast, per_client=())``: every client's reply, stacked on a
    leading axis ``M`` (``per_client`` arrays have a leading axis ``M``; client ``m`` gets
    row ``m``);
  - ``federation.one(name, client, *broadcast, own=())``: one client's reply; ``client`` may be
    traced;
  - with ``state=cs`` (a :class:`ClientState` from ``federation.init_state(initial)``), both
    call the program's ``stateful`` functions ``f(block, state, *args) -> (new_state, reply)``
    and return ``(cs', replies)``: what a client keeps between its calls stays with it (on
    Ray, on its worker, saved to the worker's disk after each call) and only the reply
    crosses.

* Decentralized algorithms (no server: :class:`~numpyro_fed.DADMMS` and its baselines) are an
  :class:`~numpyro_fed.federation.decentralized.AgentProgram`, what one agent runs with its
  own data, its own state and its neighbours' messages. A backend that
  :attr:`~Federation.runs_agents` runs it on its network,
  ``federation.agent_network(program, adjacency)``: :class:`InProcess` every agent
  ``vmap``-ped in the caller's ``jit``, :class:`RayFederation` one actor per agent sending its
  message to its neighbours' actors (never through the driver); in deployment
  ``federation.agent_hosts(loader, adjacency)`` starts agents that load their own rows first.
  A hub-and-spoke engine (Flower) refuses them with a ``TypeError``.

* :class:`MessageLedger` (``federation.ledger``): messages, bytes and rounds per client, per
  call and direction, counted by the seam: engine backends count the payloads they send,
  :class:`InProcess` its calls as they run, with sizes from shapes. A sampler whose compiled
  loop calls the clients at every event counts those calls in its own state instead
  (:meth:`Federation.counted_by_caller`).
* ``partial=True`` (``map`` and ``one``): a client that fails does not stop the call; the call
  returns who answered last (``(M,)`` bool), the failed clients' replies zeros and their
  states unchanged (they rejoin a later call: an engine first replaces a worker that died);
  ``federation.require(absent, min_clients)`` raises the :class:`ClientError` naming the
  clients out when fewer than ``min_clients`` answer. :class:`InProcess` simulates such
  faults with ``InProcess(faults=...)``.
* :class:`ClientError`: a client died, stopped answering within the timeout, or failed.
  Compiled code that calls a backend's host callbacks should run under
  ``with federation.guard():`` so the error surfaces as itself.
  :class:`NetworkError`, a ``ClientError`` of a decentralized run (an agent of
  :class:`~numpyro_fed.DADMMS` and its baselines), also carries the state to resume from and
  the draws computed before the fault.

>>> import jax, jax.numpy as jnp
>>> from numpyro_fed.federation import ClientProgram, InProcess
>>> program = ClientProgram.stacked({"grad": lambda block, w: block * w},
...                                 jnp.arange(4.0).reshape(2, 2))
>>> with InProcess().start(program) as fed:
...     replies = jax.jit(jax.vmap(lambda w: fed.map("grad", w)))(jnp.ones((3, 2)))
>>> replies.shape  # 3 chains, 2 clients, reply (2,)
(3, 2, 2)
"""

from numpyro_fed.federation.base import ClientError, ClientProgram, ClientState, Federation, NetworkError
from numpyro_fed.federation.inprocess import InProcess
from numpyro_fed.federation.ledger import MessageLedger
from numpyro_fed.federation.ray_backend import RayFederation

__all__ = [
    "ClientError",
    "ClientProgram",
    "ClientState",
    "Federation",
    "InProcess",
    "MessageLedger",
    "NetworkError",
    "RayFederation",
]
