"""FedZigZag's clients' program: the named calls each client answers on its own rows (the
set-up calls of :mod:`~numpyro_fed.infer.zigzag.setup`, ``"row_curvature"`` with
subsampling, and the rounds' ``"propose"``), and the federation started on it.

A federation keeps the program it was started on (and what its workers compiled) while the
program does not change: :class:`ProgramCache` restarts it only when the clients' rows or the
settings the program depends on change (:func:`program_key`; in deployment, where the server
cannot see the rows, at every set-up), and carries what the set-up calls counted in the
federation's ledger across a restart.

With ``private_randomness`` each client folds the key the server sends with a seed it drew
from its operating system's entropy where it loaded its rows
(:mod:`numpyro_fed.privacy.randomness`, the mechanism every private algorithm shares), so
the server cannot know the key a client draws its proposals from.
"""

from __future__ import annotations

import hashlib
from functools import partial

import numpy as np

import jax

from numpyro_fed.federation import ClientProgram
from numpyro_fed.federation.ledger import DIRECTIONS
from numpyro_fed.infer.zigzag.proposers import term_functions
from numpyro_fed.infer.zigzag.setup import setup_functions
from numpyro_fed.infer.zigzag.subsample import RowHessianBound, row_curvature
from numpyro_fed.infer.zigzag.subsample_setup import REMAINDER_CALL, remainder_state
from numpyro_fed.privacy.randomness import PrivateSeed, private_program

__all__ = ["ProgramCache", "client_calls", "program_key"]


def program_key(*parts):
    """A digest of what the clients' program depends on (their rows and its settings)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(parts):
        array = np.asarray(leaf)
        digest.update(repr((array.shape, array.dtype.str)).encode())
        digest.update(array.tobytes() if array.dtype != object else repr(leaf).encode())
    return digest.hexdigest()


def _row_curvature_call(grad, layout, row_bound, block, bound_points, probe_points):
    """The clients' ``"row_curvature"`` call (see
    :func:`~numpyro_fed.infer.zigzag.subsample.row_curvature`)."""
    return row_curvature(grad, layout, block, bound_points, probe_points, row_bound)


def client_calls(
    potential,
    clients,
    *,
    layout=None,
    bounds=None,
    propose=None,
    use_reference=False,
    private_randomness=False,
    terms=False,
    remainders=False,
) -> tuple[dict, dict]:
    """``(functions, stateful)``: the clients' calls by name, ``name -> f(block, *args)``, for
    :meth:`FederatedPotential.client_program <numpyro_fed.FederatedPotential.client_program>`:
    the set-up calls, ``"row_curvature"`` with subsampling (``layout``; a
    :class:`RowHessianBound` given as ``bounds`` bounds the rows) and ``"propose"`` when known;
    and the stateful calls, ``name -> f(block, state, *args) -> (state, reply)``: with
    ``remainders`` (second-order subsampling through a federation) the set-up call
    ``"row_remainders"`` and ``"propose"`` (the client's weights, gradient and Hessian at the
    reference are its state).

    :param clients: the :class:`~numpyro_fed.infer.zigzag.ClientFunctions`.
    :param bool use_reference: the rounds send the control variates' reference point and mean
        gradient (they come before the client's key in a round's arguments).
    :param bool private_randomness: each block carries the client's private seed
        (:class:`~numpyro_fed.privacy.randomness.PrivateSeed`), folded into its key in every round.
    :param bool terms: the calls of the server's thinning too
        (:data:`~numpyro_fed.infer.zigzag.proposers.TERM_CALLS`).
    """
    functions = setup_functions(potential.flat().client_potential)
    stateful = {}
    if terms:
        functions.update(term_functions(clients))
    if layout is not None and remainders:
        row_third = bounds.third if isinstance(bounds, RowHessianBound) else None
        stateful[REMAINDER_CALL] = partial(
            remainder_state, clients.grad, functions["value_and_grad"], functions["hessian"], layout, row_third
        )
    elif layout is not None:
        row_bound = bounds.rows if isinstance(bounds, RowHessianBound) else None
        functions["row_curvature"] = partial(_row_curvature_call, clients.grad, layout, row_bound)
    if propose is not None:
        (stateful if remainders else functions)["propose"] = propose
    if not private_randomness:
        return functions, stateful
    # the round's arguments: x, v, window (and the reference point and mean gradient), then
    # the client's own: its key first (after the client's state in a stateful call)
    key_index = 3 + 2 * bool(use_reference)
    keys = {"propose": key_index} if propose is not None else {}
    return private_program(functions, stateful, keys=keys)


def carry_ledger(previous, ledger):
    """Adds the counts of ``previous`` (a :class:`~numpyro_fed.federation.MessageLedger`) to
    ``ledger``: a restarted federation keeps what its set-up calls sent."""
    for name in previous.names:
        for direction in DIRECTIONS:
            messages, nbytes = previous.count(name, direction, "messages"), previous.count(name, direction, "bytes")
            if messages.any() or nbytes.any():
                ledger.add(name, direction, None, messages=messages, nbytes=nbytes)
        rounds = previous.rounds(name)
        if rounds.any():
            ledger.add(name, "to_client", None, messages=0, nbytes=0, rounds=rounds)
    ledger.round_trips += previous.round_trips


class ProgramCache:
    """The program a sampler last started its federation on, and what it depends on: a
    federation that runs it already for the same key is not restarted."""

    def __init__(self):
        self.program = None
        self.key = None
        self.data_key = None
        self.loaded = None  # deployment: the last set-up's block loader, and how many were seen
        self.loadings = 0

    def data_key_of(self, potential, private_randomness: bool):
        """What the program depends on of the clients' data: their rows' content in
        simulation; in deployment the set-up's own loading (the rows are on the clients and
        the server cannot compare them: files rewritten with rows of the same counts are
        other data, so every ``split_potential``, i.e. every ``init``, loads them anew)."""
        if potential.deployed:
            if potential.block_loader is not self.loaded:
                self.loaded, self.loadings = potential.block_loader, self.loadings + 1
            return program_key(potential.client_sizes, "deployed", private_randomness, self.loadings)
        return program_key(potential.client_data, private_randomness)

    def runs_data(self, federation, data_key) -> bool:
        """``federation`` runs this cache's program, built for the same data."""
        return federation.started and federation.program is self.program and self.data_key == data_key

    def start(self, federation, potential, calls, key, data_key, *, private_randomness: bool):
        """Starts ``federation`` on ``calls`` (``(functions, stateful)`` of
        :func:`client_calls`: the set-up calls and, when known, the proposals) unless it runs
        this cache's program for ``key`` on the same data (``data_key``) already. What the
        set-up calls counted in the federation's ledger is kept across a restart for the same data."""
        functions, stateful = calls
        same_data = self.runs_data(federation, data_key)
        if same_data and key == self.key:
            return
        previous = federation.ledger if same_data else None
        if potential.deployed or private_randomness:
            program = potential.client_program(
                functions, transform=PrivateSeed() if private_randomness else None, stateful=stateful
            )
        else:  # cut on the host: each client's slice of a host copy of the rows compiles nothing
            program = ClientProgram.stacked(functions, jax.device_get(potential.client_data), stateful=stateful)
        federation.start(program)
        if previous is not None:
            carry_ledger(previous, federation.ledger)
        self.program, self.key, self.data_key = program, key, data_key
