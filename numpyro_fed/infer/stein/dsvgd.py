"""The DSVGD core (Kassab & Simeone, Algorithm 1): :func:`init`, the client's functions
(:func:`client_functions`, run where the client lives) and the round
``step(rng_key, state, federation, client) -> (state, info)`` (:func:`build_kernel`), written
once against the federation seam: on :class:`~numpyro_fed.federation.InProcess` the whole
round compiles into one program, on an engine backend the client's part runs on its worker.

What crosses between server and client is what the paper says: the server sends its ``N``
global particles (and whether any client has been visited yet, i.e. whether ``q^(i-1)`` is
still the prior); the scheduled client sends back ``N`` new global particles. Its local
particles never leave it: they are its client state
(:class:`~numpyro_fed.federation.ClientState`), kept where the client lives (stacked in
:attr:`DSVGDState.clients` in process; on its worker with an engine backend).

>>> import jax, jax.numpy as jnp
>>> from numpyro_fed.federation import ClientProgram, InProcess
>>> from numpyro_fed.infer.stein import adagrad_momentum
>>> # N(0, 1) prior, one client with L(x) = (x - 2)^2 / 2: the posterior is N(1, 1/2)
>>> functions, stateful = client_functions(lambda x: x, lambda x, block: x - block, num_local_steps=500,
...                                        num_distill_steps=100, optim=adagrad_momentum(0.1))
>>> federation = InProcess().start(ClientProgram.stacked(functions, jnp.array([2.0]), stateful=stateful))
>>> x0 = jax.random.normal(jax.random.PRNGKey(0), (50, 1))
>>> state, info = build_kernel()(None, init(x0, federation), federation, 0)
>>> abs(float(state.global_particles.mean()) - 1.0) < 0.1, info.client.tolist()
(True, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.federation import ClientState
from numpyro_fed.infer.stein.cavity import (
    AUTO_TAIL,
    carrier_score_of,
    carrier_weight,
    cavity_power,
    gaussian_score,
    negative_hessian,
    precision_of,
)
from numpyro_fed.infer.stein.curvature import laplace_start, round_frame
from numpyro_fed.infer.stein.factors import distill, round_scores
from numpyro_fed.infer.stein.kde import check_kde_bandwidth, kde_score_fn
from numpyro_fed.infer.stein.kernels import wide_median_bandwidth
from numpyro_fed.infer.stein.svgd import staged_svgd
from numpyro_fed.infer.stein.whitening import whitening

__all__ = [
    "AUTO_STAGES",
    "ClientMessage",
    "ClientUpdate",
    "DSVGDInfo",
    "DSVGDState",
    "LocalState",
    "RoundConfig",
    "batched_client_grad",
    "build_client",
    "build_kernel",
    "check_key",
    "client_functions",
    "init",
    "initial_local_states",
    "round_config",
    "server_update",
    "start_and_frame",
    "update_particles",
]

#: SVGD stages per loop of a round with ``kde_bandwidth="auto"`` (see
#: :func:`~numpyro_fed.infer.stein.svgd.staged_svgd`).
AUTO_STAGES = 4


class LocalState(NamedTuple):
    """What a DSVGD client keeps between its rounds (its client state).

    :ivar local_particles: ``(N, d)``, its local particles: their KDE over the prior encodes
        ``p_0 t_k``, a proper density.
    :ivar visited: whether it has been scheduled before (before its first round, ``t_k^(0) =
        1`` exactly, Algorithm 1, line 1).
    :ivar carrier_mean: ``(d,)``, :ivar carrier_chol: ``(d, d)`` and :ivar carrier_weight:
        ``()``, the carrier ``c_k = p_0 N(mean, chol chol^T)^weight`` of the factor
        (``kde_bandwidth="auto"``, :func:`carrier_weight`): the local particles encode
        ``c_k t_k``. ``None``: they encode ``p_0 t_k``.

    Why a carrier: ``p_0 t_k`` is improper under a flat prior, or where the client's rows say
    little about a coordinate (``t_k`` is then a ratio of two KDEs of about equal width); the
    least power of a Gaussian that keeps ``c_k t_k`` proper makes its distillation stable and
    leaves ``t_k`` as it was (measurements: the DSVGD guide, *Real scales*).
    """

    local_particles: jax.Array
    visited: jax.Array
    carrier_mean: jax.Array | None = None
    carrier_chol: jax.Array | None = None
    carrier_weight: jax.Array | None = None


class DSVGDState(NamedTuple):
    """State of DSVGD (Algorithm 1).

    :ivar global_particles: ``(N, d)``, the server's particles.
    :ivar clients: a :class:`~numpyro_fed.federation.ClientState` of every client's
        :class:`LocalState`: in process, its ``values`` stack them (leading axis ``K``); with an
        engine backend each client's stays on its worker and ``values`` is empty.
    :ivar visited: ``(K,)`` bool, the clients whose update the server has received.
    :ivar round: rounds done.
    :ivar absent: ``(K,)`` bool, the clients whose last scheduled round failed (a run with
        ``min_clients``, see :func:`build_kernel`).

    Before its first round a client's local particles are the initial prior draws, but the
    rounds use ``t_k^(0) = 1`` (Algorithm 1, line 1) exactly for a client not yet visited,
    and ``q^(0) = p_0`` exactly while no client has been visited: a KDE of a few prior draws
    is a poor stand-in for the prior in many dimensions.
    """

    global_particles: jax.Array
    clients: ClientState
    visited: jax.Array
    round: jax.Array
    absent: jax.Array | None = None

    @property
    def local_particles(self) -> jax.Array:
        """``(K, N, d)``: every client's local particles, where they are kept in this process
        (``clients.values``; a ``ValueError`` when the clients keep them on their workers)."""
        return local_particles_of(self.clients)


class DSVGDInfo(NamedTuple):
    """Diagnostics of one round.

    :ivar client: the scheduled client(s).
    :ivar move: root mean square distance the global particles moved in the round.
    :ivar participated: ``(K,)`` bool, the client whose update the round applied (``None``
        in the variants that do not record it).
    """

    client: jax.Array
    move: jax.Array
    participated: jax.Array | None = None


class ClientMessage(NamedTuple):
    """What the server sends the scheduled client.

    :ivar global_particles: ``(N, d)``.
    :ivar first: whether no client has been visited yet (then ``q^(i-1) = p_0`` exactly).
    """

    global_particles: jax.Array
    first: jax.Array


class ClientUpdate(NamedTuple):
    """What a client computes in its round.

    :ivar global_particles: ``(N, d)``, the new global particles (uploaded in DSVGD).
    :ivar local_particles: ``(N, d)``, its new local particles (kept; uploaded in P-DSVGD).
    :ivar carrier: ``(mean, chol, weight)`` of their carrier (:class:`LocalState`), or ``None``.
    """

    global_particles: jax.Array
    local_particles: jax.Array
    carrier: tuple | None = None


def local_particles_of(clients: ClientState) -> jax.Array:
    """The clients' local particles from an in-process :class:`~numpyro_fed.federation.ClientState`."""
    if not jax.tree_util.tree_leaves(clients.values):
        raise ValueError(
            "the clients keep their local particles on their workers (an engine backend): the server's state holds none"
        )
    return clients.values.local_particles


def initial_local_states(particles, num_clients: int, carrier: bool = False) -> LocalState:
    """Every client's :class:`LocalState` of Algorithm 1, line 1 (stacked): its local
    particles are copies of the initial (prior) draws, public values the server drew
    (``carrier``: with a Gaussian carrier, a placeholder until the client's first round)."""
    particles = jnp.asarray(particles)
    local = LocalState(jnp.broadcast_to(particles, (num_clients,) + particles.shape), jnp.zeros(num_clients, bool))
    if not carrier:
        return local
    d = particles.shape[-1]
    eye = jnp.eye(d, dtype=particles.dtype)
    return local._replace(
        carrier_mean=jnp.zeros((num_clients, d), particles.dtype),
        carrier_chol=jnp.broadcast_to(eye, (num_clients, d, d)),
        carrier_weight=jnp.zeros(num_clients, particles.dtype),
    )


def init(particles, federation, carrier: bool = False) -> DSVGDState:
    """The state of Algorithm 1, line 1: every client's local particles are copies of the
    prior draws ``particles`` (``(N, d)``), handed to the clients of the started
    ``federation`` through its ``init_state`` (they keep them: in this process with
    :class:`~numpyro_fed.federation.InProcess`, on their workers with an engine backend).

    >>> import jax.numpy as jnp
    >>> from numpyro_fed.federation import ClientProgram, InProcess
    >>> federation = InProcess().start(ClientProgram.stacked({}, jnp.zeros((3, 1))))
    >>> init(jnp.zeros((5, 2)), federation).clients.values.local_particles.shape
    (3, 5, 2)

    ``carrier``: the clients' local particles encode ``c_k t_k`` with a Gaussian carrier
    (:class:`LocalState`), the default's choice with ``kde_bandwidth="auto"``.
    """
    particles = jnp.asarray(particles)
    num_clients = federation.num_clients
    return DSVGDState(
        global_particles=particles,
        clients=federation.init_state(initial_local_states(particles, num_clients, carrier)),
        visited=jnp.zeros(num_clients, bool),
        round=jnp.zeros((), jnp.int32),
        absent=jnp.zeros(num_clients, bool),
    )


def batched_client_grad(client_grad: Callable, stochastic_client_grad: Callable | None = None) -> Callable:
    """``(x (N, d), block, key) -> (N, d)``: the minibatch estimate
    ``stochastic_client_grad(x, block, key)`` when a key is given and that function exists, the
    full-batch ``client_grad(x_n, block)`` at every particle otherwise."""
    full = jax.vmap(client_grad, in_axes=(0, None))
    if stochastic_client_grad is None:
        return lambda x, block, key=None: full(x, block)
    return lambda x, block, key=None: full(x, block) if key is None else stochastic_client_grad(x, block, key)


def check_key(rng_key, stochastic_client_grad):
    """Refuses a round with minibatches (``stochastic_client_grad``) but no key."""
    if stochastic_client_grad is not None and rng_key is None:
        raise ValueError("a round with stochastic_client_grad needs a key: step(rng_key, state, federation, client)")


def update_particles(
    global_particles,
    local_particles,
    block,
    *,
    prior_score,
    client_grad,
    kde_score,
    temperature,
    num_local_steps,
    num_distill_steps,
    optim,
    distill_optim,
    svgd_bandwidth,
    rng_key=None,
    visited=True,
    first=False,
    stages=1,
    curvature=False,
    carrier_score=None,
    new_carrier_score=None,
) -> ClientUpdate:
    """Lines 4-7 of Algorithm 1 at one client, in the coordinates the scores are given in.

    The local particles encode ``c_k t_k`` (a proper density), so that
    ``grad log t_k = grad log KDE(local) - grad log c_k``; the carrier ``c_k`` is the prior
    ``p_0`` unless ``carrier_score`` (``grad log c_k``) is given, and the new local particles
    encode ``c_k' t_k^(i)`` with ``new_carrier_score`` (``(new_global, weight) -> grad log c_k'``,
    ``weight`` of :func:`carrier_weight`, returned as the update's ``carrier``; default: the
    same carrier). Where Algorithm 1 knows the densities exactly, they are used instead of
    KDEs: ``t_k^(0) = 1`` for a client not yet ``visited``, and ``q^(0) = p_0`` while no client
    has been visited (``first``). ``client_grad(x, block, key)`` is the batched gradient of
    ``L_k`` (``key``: a fresh key per step, ``None`` without one); ``kde_score(x, centers)`` the
    gradient of the log KDE of ``centers`` at ``x``.
    """
    guarded = carrier_score is not None
    carrier_score = prior_score if carrier_score is None else carrier_score
    score_previous, score_local = round_scores(
        global_particles, local_particles, prior_score, kde_score, visited=visited, first=first, carrier=carrier_score
    )
    power = 1.0
    if guarded:
        power = jnp.where(
            visited,
            cavity_power(
                global_particles, local_particles, carrier_score, lambda x: client_grad(x, block, None), temperature
            ),
            1.0,
        )

    def factor_score(x):  # grad log t_k^(i-1), raised to the cavity's power
        return power * (score_local(x) - carrier_score(x))

    def tilted_score(x, step_key=None):  # Eq. (14)
        return score_previous(x) - factor_score(x) - client_grad(x, block, step_key) / temperature

    new_global = staged_svgd(
        global_particles, tilted_score, num_local_steps, optim, svgd_bandwidth, rng_key, stages, curvature
    )
    rebase, weight = None, None
    if new_carrier_score is not None:
        old_factor = AUTO_TAIL * precision_of(local_particles) - negative_hessian(
            carrier_score, jnp.mean(global_particles, 0)
        )
        weight = carrier_weight(
            new_global,
            jnp.where(first, jnp.nan, precision_of(global_particles)),
            jnp.where(visited, power * old_factor, 0.0),
            prior_score,
        )
        new_carrier = new_carrier_score(new_global, weight)

        def rebase(x):  # c_k' / c_k
            return new_carrier(x) - carrier_score(x)

    new_local = distill(
        new_global,
        local_particles,
        score_previous,
        lambda x: factor_score(x) + carrier_score(x),
        kde_score=kde_score,
        num_distill_steps=num_distill_steps,
        distill_optim=distill_optim,
        svgd_bandwidth=svgd_bandwidth,
        visited=visited,
        stages=stages,
        curvature=curvature,
        rebase=rebase,
    )
    return ClientUpdate(new_global, new_local, weight)


class RoundConfig(NamedTuple):
    """The settings of a round shared by the cores of DSVGD, P-DSVGD and U-DSVGD
    (:func:`round_config`).

    :ivar kde_bandwidth: ``"auto"`` or the KDE kernel's standard deviation.
    :ivar svgd_bandwidth: the SVGD kernel's ``h`` (a number, a function of the particles or
        ``None``: the median heuristic).
    :ivar stages: SVGD stages per loop (:data:`AUTO_STAGES` with ``"auto"``, else 1).
    :ivar prior_score: ``(N, d) -> (N, d)``, ``grad log p_0`` at every particle.
    :ivar client_grad: ``(x (N, d), block, key) -> (N, d)`` (:func:`batched_client_grad`).
    :ivar curvature: whether the round's coordinates and its SVGD stages follow the target's
        curvature, and the first round starts from the Laplace approximation of its target
        (``"auto"``; see :func:`start_and_frame`).
    """

    kde_bandwidth: float | str
    svgd_bandwidth: object
    stages: int
    prior_score: Callable
    client_grad: Callable
    curvature: bool


def round_config(prior_grad, client_grad, stochastic_client_grad, kde_bandwidth, svgd_bandwidth) -> RoundConfig:
    """The :class:`RoundConfig` of a method's arguments: ``kde_bandwidth`` checked, the SVGD
    bandwidth defaulting to :func:`~numpyro_fed.infer.stein.kernels.wide_median_bandwidth`
    with ``kde_bandwidth="auto"``."""
    kde_bandwidth = check_kde_bandwidth(kde_bandwidth)
    if kde_bandwidth == "auto" and svgd_bandwidth is None:
        svgd_bandwidth = wide_median_bandwidth
    return RoundConfig(
        kde_bandwidth,
        svgd_bandwidth,
        AUTO_STAGES if kde_bandwidth == "auto" else 1,
        jax.vmap(lambda x: -prior_grad(x)),
        batched_client_grad(client_grad, stochastic_client_grad),
        kde_bandwidth == "auto",
    )


def start_and_frame(config: RoundConfig, particles, block, temperature, first):
    """The particles a client's round starts from and the round's coordinates
    (:func:`~numpyro_fed.infer.stein.curvature.round_frame`).

    With ``config.curvature`` the coordinates follow the curvature of the client's own
    posterior ``p_0 exp(-L_k / alpha)`` (full batch) at the particles, and in the run's first
    round (``first``: ``q = p_0`` exactly, and the particles are where the run started, no
    density) they start from the Laplace approximation of that target
    (:func:`~numpyro_fed.infer.stein.curvature.laplace_start`): initial particles may lie
    hundreds of posterior sds from it, or be that much wider, further than SVGD's steps go.
    """

    def local_score(x):
        return config.prior_score(x) - config.client_grad(x, block, None) / temperature

    if not config.curvature:
        return particles, round_frame(config.kde_bandwidth, particles, config.prior_score, config.client_grad)
    particles = lax.cond(first, lambda x: laplace_start(x, local_score), lambda x: x, particles)
    frame = round_frame(config.kde_bandwidth, particles, config.prior_score, config.client_grad, local_score)
    return particles, frame


def build_client(
    prior_grad: Callable,
    client_grad: Callable,
    *,
    num_local_steps: int,
    num_distill_steps: int,
    optim,
    distill_optim=None,
    kde_bandwidth: float | str = "auto",
    svgd_bandwidth=None,
    temperature: float = 1.0,
    stochastic_client_grad: Callable | None = None,
) -> Callable:
    """A DSVGD client: ``client(rng_key, message, local_particles, visited, block) -> ClientUpdate``.

    ``message`` is the server's :class:`ClientMessage`; ``local_particles`` (``(N, d)``) and
    ``visited`` are what the client keeps between its rounds; ``block`` its rows. The returned
    particles are in the model's (flat, unconstrained) coordinates.

    :param prior_grad: ``(d,) -> (d,)``, gradient of the prior potential ``-log p_0``.
    :param client_grad: ``((d,), block) -> (d,)``, gradient of client ``k``'s loss ``L_k``
        given its data ``block``.
    :param int num_local_steps: ``L``, SVGD steps towards the tilted distribution.
    :param int num_distill_steps: ``L'``, distillation steps.
    :param optim: optax step rule of the ``L`` steps (fresh state every round).
    :param distill_optim: step rule of the ``L'`` steps (default: ``optim``).
    :param kde_bandwidth: ``"auto"``: the round's densities are defined in the coordinates
        that whiten the global particles it starts from, with moment-keeping KDEs
        (:func:`~numpyro_fed.infer.stein.kde.shrunk_kde`); each SVGD loop runs in
        :data:`AUTO_STAGES` stages that re-whiten its own particles; a client's first
        distillation starts from the uploaded particles. Nothing then depends on the units of
        the parameters. A float: the paper's algorithm as published, a KDE kernel of that
        standard deviation in the model's own coordinates (the paper uses 0.55).
    :param svgd_bandwidth: ``h`` of the SVGD kernel (in whitened coordinates with
        ``kde_bandwidth="auto"``); ``None``: ``wide_median_bandwidth`` with
        ``kde_bandwidth="auto"``, the median heuristic otherwise.
    :param float temperature: ``alpha``.
    :param stochastic_client_grad: ``((N, d), block, key) -> (N, d)``, an unbiased estimate
        of ``grad L_k`` at every particle from a minibatch drawn with ``key``; used instead of
        ``client_grad`` in the ``L`` steps, with a fresh key per step split from ``rng_key``
        (which must then be given; otherwise it is not used).
    """
    distill_optim = optim if distill_optim is None else distill_optim
    config = round_config(prior_grad, client_grad, stochastic_client_grad, kde_bandwidth, svgd_bandwidth)
    kde_score = kde_score_fn(config.kde_bandwidth)

    def client(rng_key, message: ClientMessage, local_particles, visited, block, carrier=None) -> ClientUpdate:
        check_key(rng_key, stochastic_client_grad)
        key = rng_key if stochastic_client_grad is not None else None
        start, frame = start_and_frame(config, message.global_particles, block, temperature, message.first)
        carrier_options = {}
        if carrier is not None:
            # c_k and the next carrier (the moments of the new global particles) in the round's coordinates
            def in_frame(score_x):
                return lambda z: frame.score_to_z(score_x(frame.from_z(z)))

            def new_carrier_score(new_global_z, weight):
                w = whitening(frame.from_z(new_global_z))
                gaussian = in_frame(gaussian_score(w.mean, w.chol))
                return lambda z: frame.prior_score(z) + weight * gaussian(z)

            old = carrier_score_of(carrier, lambda x: jnp.zeros_like(x))
            carrier_options = dict(
                carrier_score=lambda z: frame.prior_score(z) + in_frame(old)(z), new_carrier_score=new_carrier_score
            )
        update = update_particles(
            frame.to_z(start),
            frame.to_z(local_particles),
            block,
            prior_score=frame.prior_score,
            client_grad=frame.client_grad,
            kde_score=kde_score,
            temperature=temperature,
            num_local_steps=num_local_steps,
            num_distill_steps=num_distill_steps,
            optim=optim,
            distill_optim=distill_optim,
            svgd_bandwidth=config.svgd_bandwidth,
            rng_key=key,
            visited=visited,
            first=message.first,
            stages=config.stages,
            curvature=config.curvature,
            **carrier_options,
        )
        new_global = frame.from_z(update.global_particles)
        new_carrier = None
        if carrier is not None:
            w = whitening(new_global)
            new_carrier = (w.mean, w.chol, update.carrier)
        return ClientUpdate(new_global, frame.from_z(update.local_particles), new_carrier)

    return client


def server_update(
    state: DSVGDState, client, new_global, clients: ClientState, answered=True
) -> tuple[DSVGDState, DSVGDInfo]:
    """The server's side of a round: the uploaded particles become the global ones;
    ``clients`` is the clients' state after the round (the scheduled client's moved on where
    it lives). A client that did not ``answer`` (a ``partial`` call) leaves the global
    particles as they were (and its local ones: the federation kept its state), and is
    marked ``absent`` until it answers a later round."""
    answered = jnp.asarray(answered)
    num_clients = state.visited.shape[0]
    new_global = jnp.where(answered, new_global, state.global_particles)
    move = jnp.sqrt(jnp.mean(jnp.sum((new_global - state.global_particles) ** 2, axis=-1)))
    absent = jnp.zeros(num_clients, bool) if state.absent is None else state.absent
    state = DSVGDState(
        global_particles=new_global,
        clients=clients,
        visited=state.visited.at[client].set(state.visited[client] | answered),
        round=state.round + 1,
        absent=absent.at[client].set(~answered),
    )
    participated = jnp.zeros(num_clients, bool).at[client].set(answered)
    return state, DSVGDInfo(jnp.asarray(client), move, participated)


def client_functions(prior_grad: Callable, client_grad: Callable, **options) -> tuple[dict, dict]:
    """What a DSVGD client runs, ``(functions, stateful)`` as a
    :class:`~numpyro_fed.federation.ClientProgram` takes them: no function of its block alone,
    and one of its own :class:`LocalState`, ``"update"``: ``(block, local, global_particles,
    first, [key]) -> (local', new global particles)``, from the server's
    :class:`ClientMessage` (and, with ``stochastic_client_grad``, the round's key for the
    minibatches). The new local particles stay with the client; only the new global
    particles go back. Options as :func:`build_client`."""
    client_fn = build_client(prior_grad, client_grad, **options)

    def update(block, local: LocalState, global_particles, first, key=None):
        carrier = None if local.carrier_mean is None else (local.carrier_mean, local.carrier_chol, local.carrier_weight)
        new = client_fn(
            key, ClientMessage(global_particles, first), local.local_particles, local.visited, block, carrier
        )
        new_local = LocalState(new.local_particles, jnp.ones_like(local.visited))
        if new.carrier is not None:
            mean, chol, weight = new.carrier
            new_local = new_local._replace(carrier_mean=mean, carrier_chol=chol, carrier_weight=weight)
        return new_local, new.global_particles

    if options.get("stochastic_client_grad") is None:
        return {}, {
            "update": lambda block, local, global_particles, first: update(block, local, global_particles, first)
        }
    return {}, {"update": update}


def build_kernel(stochastic: bool = False, min_clients: int | None = None) -> Callable:
    """One round of DSVGD (Algorithm 1): ``step(rng_key, state, federation, client) -> (state,
    info)``. The server sends the scheduled ``client`` (an index, may be traced) its
    :class:`ClientMessage` through ``federation`` (started on :func:`client_functions`); the
    client moves its local particles (its ``"update"``, on its own :class:`LocalState`) and
    returns the new global particles; :func:`server_update` keeps them. ``stochastic``: the
    round's ``rng_key`` goes to the client (its minibatches; otherwise ``rng_key`` is unused
    and may be ``None``).

    **Clients that drop out.** With ``min_clients`` (``None``: a failure stops the round with
    a :class:`~numpyro_fed.federation.ClientError`) the call is ``partial``: a scheduled
    client that fails or does not answer has its particle update skipped, the round leaving
    the global particles and its local particles as they were (the analogue of PVI's rule: a
    round may update any subset of the factors, here the empty one; ``q`` and ``t_k`` stay
    consistent because neither moved). It is marked ``absent`` and counts as out until a
    later round of it answers; the round raises the ``ClientError`` naming those out when
    fewer than ``min_clients`` of the ``K`` clients are in."""

    def step(rng_key, state: DSVGDState, federation, client):
        first = ~jnp.any(state.visited)
        key = (rng_key,) if stochastic else ()
        partial = min_clients is not None
        out = federation.one(
            "update", client, state.global_particles, first, *key, state=state.clients, partial=partial
        )
        clients, new_global, answered = out if partial else out + (True,)
        state, info = server_update(state, client, new_global, clients, answered)
        if partial:
            state = state._replace(absent=federation.require(state.absent, min_clients))
        return state, info

    return step
