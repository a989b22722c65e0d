"""DSVGD with client-local latent variables: each client moves joint particles ``(theta, z_k)``.

A model's latent space splits into the global coordinates ``theta`` (outside every federated
plate) and, for each client ``k``, the coordinates ``z_k`` it owns (its rows of the federated
plates: its schools' effects, its counties' intercepts; :attr:`FederatedPotential.coordinate_owner
<numpyro_fed.FederatedPotential.coordinate_owner>`). The posterior is

    p(theta, z_1..z_K) ∝ p_0(theta) prod_k exp(-U_k(theta, z_k))

where ``U_k`` is client ``k``'s term of :func:`~numpyro_fed.split_potential` (the prior of its
``z_k`` given ``theta`` and the likelihood of its rows). Integrating ``z_k`` out gives DSVGD's
target ``p_0(theta) prod_k exp(-L_k(theta))`` with ``exp(-L_k(theta)) = ∫ exp(-U_k(theta, z_k))
dz_k``: the approximate likelihood ``t_k(theta)`` of Algorithm 1 stands for that marginal, so
the server's ``q(theta) = p_0 prod_k t_k`` and everything it sends are those of a model
without local latents. Only the client's step changes: its tilted distribution (Eq. (14)),

    q^(i-1)(theta) / t_k^(i-1)(theta) exp(-U_k(theta, z_k) / alpha),

is a density on ``(theta, z_k)`` whose ``theta``-marginal is the paper's tilted distribution
with ``L_k``. SVGD on the joint space samples it without ever evaluating ``L_k``: each of the
``N`` global particles gets a partner ``z_k`` (the client's *latent* particles, kept as its
client state and warm-started from its last round by particle index), the ``L`` steps move
the pairs with one RBF kernel on the joint coordinates (the conditional dependence of
``z_k`` on ``theta``, e.g. a school effect on the population's scale, is what the kernel
must see: a kernel on ``z_k`` alone cannot keep the pairs' correlation), and the new
``theta`` halves are ``q^(i)``, distilled into ``t_k`` (Eq. (17)) and uploaded exactly as in
Algorithm 1. The ``z_k`` halves never leave the client.

After the rounds the server's ``theta`` particles have moved since a client's last round,
and the server has no score of their marginal posterior (each client's term involves its own
``z_k``). A client gives the gradient of its marginal term, ``grad L_k(theta) = E[grad_theta
U_k(theta, z_k) | theta]`` (Fisher's identity), at each global particle without sending its
latents: :func:`marginal_scores`, by importance sampling from the Laplace approximation of its
conditional ``p(z_k | theta, D_k)`` (exact where that conditional is Gaussian, as a linear-
Gaussian group effect's is). With it the server checks and corrects the global particles as
for a model without local latents, and a result's draws of the local sites are the clients'
draws of their conditionals given the global particles (:func:`draw_conditionals`, the
``"draw_latents"`` call). :func:`refresh_latents`, SVGD steps in ``z_k`` only towards the
conditional, is what a client built without its term's value (``client_potential``) does.

Each round a client also spreads its particles of ``p_0 t_k`` to at least the global
particles' covariance in every direction (:func:`no_wider_cavity`): in a direction its own term leaves
flat (a hierarchical scale as it goes to 0), a cavity ``q / (p_0 t_k)`` of negative precision,
the noise of two KDEs of ``N`` particles, would make the tilted distribution improper. Its
distillation, towards ``c_k t_k q^(i) / q^(i-1)``, likewise reads ``q^(i-1)`` from the round's
starting particles spread to at least ``q^(i)``'s covariance: where ``q^(i)`` came out wider,
the ratio of KDEs grows without bound and the client's particles of ``c_k t_k`` ran away (a
centred random-intercept model's ``log sigma`` to -40 in a first distillation).

Clients own different numbers of coordinates; their latent particles are padded to the
largest, each padded coordinate a standard normal of its own (a proper, separate factor:
SVGD keeps it in place, and the curvature and whitening of the joint space stay well
conditioned), dropped when the draws are assembled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.stein.curvature import CONVERGED_DECREMENT, laplace_start, newton_modes, positive_curvature
from numpyro_fed.infer.stein.dsvgd import round_config
from numpyro_fed.infer.stein.factors import distill, round_scores
from numpyro_fed.infer.stein.kde import kde_score_fn
from numpyro_fed.infer.stein.kernels import svgd_direction
from numpyro_fed.infer.stein.svgd import staged_svgd
from numpyro_fed.infer.stein.whitening import Whitening, whitening

__all__ = [
    "CONDITIONAL_DRAWS",
    "ConditionalLaplace",
    "JointLocalState",
    "LatentLayout",
    "check_own_latents",
    "client_functions",
    "conditional_draws",
    "conditional_laplace",
    "draw_conditionals",
    "embed",
    "global_prior_grad",
    "init",
    "initial_local_states",
    "joint_gradients",
    "joint_potential",
    "latent_layout",
    "marginal_scores",
    "no_wider_cavity",
    "refresh_latents",
]


class LatentLayout(NamedTuple):
    """Where the global coordinates and each client's own are in the flat latent vector.

    :ivar global_index: ``(d_g,)`` positions of the global coordinates.
    :ivar positions: ``(K, d_l)`` positions of each client's coordinates, padded with
        ``num_latent`` (out of range) to the largest client's count ``d_l``.
    :ivar valid: ``(K, d_l)``, which of ``positions`` are the client's (not padding).
    :ivar int num_latent: ``d``, the length of the flat vector.
    :ivar tuple local_sites: the names of the client-local sites.
    """

    global_index: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    num_latent: int
    local_sites: tuple

    @property
    def num_global(self) -> int:
        return int(self.global_index.shape[0])

    def split(self, particles):
        """``(N, d)`` full particles -> ``(theta (N, d_g), z (K, N, d_l))``; padding 0."""
        particles = jnp.asarray(particles)
        z = jnp.take(particles, jnp.asarray(self.positions), axis=1, mode="fill", fill_value=0)
        return particles[:, self.global_index], jnp.moveaxis(z, 1, 0)

    def assemble(self, theta, z):
        """``theta (N, d_g)`` and every client's ``z (K, N, d_l)`` -> ``(N, d)`` full particles."""
        x = jnp.zeros((theta.shape[0], self.num_latent), theta.dtype).at[:, jnp.asarray(self.global_index)].set(theta)
        for k in range(self.positions.shape[0]):
            x = x.at[:, jnp.asarray(self.positions[k])].set(z[k], mode="drop")
        return x


def latent_layout(fp) -> LatentLayout | None:
    """The :class:`LatentLayout` of a :class:`~numpyro_fed.FederatedPotential`, ``None`` when
    every latent variable is global."""
    owner = np.asarray(fp.coordinate_owner)
    if not (owner >= 0).any():
        return None
    num_clients, d = int(fp.num_clients), int(owner.shape[0])
    own = [np.flatnonzero(owner == k) for k in range(num_clients)]
    width = max(len(p) for p in own)
    positions = np.full((num_clients, width), d, np.int32)
    valid = np.zeros((num_clients, width), bool)
    for k, p in enumerate(own):
        positions[k, : len(p)], valid[k, : len(p)] = p, True
    local = tuple(name for name, o in fp.coordinate_owner_tree.items() if (np.asarray(o) >= 0).any())
    return LatentLayout(np.flatnonzero(owner < 0).astype(np.int32), positions, valid, d, local)


def embed(theta, z, positions, layout: LatentLayout):
    """The full ``(N, d)`` points with ``theta`` at the global coordinates, ``z`` at
    ``positions`` (padding dropped) and 0 elsewhere: another client's coordinates, which a
    client's term does not depend on (:func:`check_own_latents`)."""
    x = jnp.zeros(theta.shape[:1] + (layout.num_latent,), theta.dtype)
    x = x.at[:, jnp.asarray(layout.global_index)].set(theta)
    return x.at[:, positions].set(z, mode="drop")


def check_own_latents(fp, layout: LatentLayout, client_grad: Callable, x0) -> None:
    """Refuses (``ValueError`` naming the site) a model in which a client's term depends on
    latent coordinates another client owns (e.g. data rows indexing a school another client
    holds), checked by the gradient of every client's term at ``x0`` (``(d,)``) in
    simulation: DSVGD's clients each move their own coordinates only."""
    if fp.client_data is None:
        return
    grads = np.asarray(jax.jit(jax.vmap(client_grad, in_axes=(None, 0)))(jnp.asarray(x0), fp.client_data))
    owner = np.asarray(fp.coordinate_owner)
    foreign = (owner[None, :] >= 0) & (owner[None, :] != np.arange(fp.num_clients)[:, None])
    bad = foreign & (np.abs(grads) > 0)
    if bad.any():
        names = np.concatenate(
            [np.full(np.size(o), name, object) for name, o in fp.coordinate_owner_tree.items()]
        )  # the order of ravel: coordinate_owner_tree is a dict like the latent values
        k, j = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"client {k}'s term depends on site '{names[j]}' at a coordinate client {int(owner[j])} owns: "
            "each client's rows must use only the client-local latents of its own plate rows "
            "(assign a group's rows to the client that owns the group)"
        )


def global_prior_grad(prior_grad: Callable, layout: LatentLayout) -> Callable:
    """``(d_g,) -> (d_g,)``: the gradient of the prior term (which holds the global sites
    only; a client-local site's prior is in its client's term) in the global coordinates,
    from ``prior_grad`` on the full ``(d,)`` vector."""
    index = jnp.asarray(layout.global_index)

    def grad(theta):
        return prior_grad(jnp.zeros(layout.num_latent, theta.dtype).at[index].set(theta))[index]

    return grad


#: full Newton steps after a conditional's mode search has converged (:func:`conditional_laplace`)
POLISH_STEPS = 3

#: Importance draws per particle of a client's conditional ``p(z_k | theta)`` behind its marginal
#: score (:func:`marginal_scores`).
CONDITIONAL_DRAWS = 64


def conditional_draws(rng_key, num_draws: int, dim: int, dtype):
    """``(S, dim)`` draws for the importance proposals of :func:`marginal_scores`: standard
    normal draws in antithetic pairs (their mean exactly 0), rescaled so that their second
    moment is exactly the identity. ``S`` is ``num_draws``, or ``2 (dim + 1)`` if larger (the
    second moment needs more draws than coordinates), rounded up to an even number.

    >>> import jax, jax.numpy as jnp
    >>> eps = conditional_draws(jax.random.PRNGKey(0), 8, 5, jnp.float32)
    >>> eps.shape, bool(jnp.allclose(eps.T @ eps / eps.shape[0], jnp.eye(5), atol=1e-5))
    ((12, 5), True)
    """
    half = max((int(num_draws) + 1) // 2, dim + 1)
    draws = jax.random.normal(rng_key, (half, dim), dtype)
    chol = jnp.linalg.cholesky(draws.T @ draws / half)
    draws = jax.scipy.linalg.solve_triangular(chol, draws.T, lower=True).T
    return jnp.concatenate([draws, -draws])


def marginal_scores(theta, starts, joint_value, joint_grads, rng_key, num_draws: int = CONDITIONAL_DRAWS):
    """``(scores (N, d_g), ess (N,))``: the gradient of a client's marginal term
    ``L_k(theta) = -log ∫ exp(-U_k(theta, z)) dz`` at each of the global particles ``theta``
    (``(N, d_g)``), by Fisher's identity ``grad L_k(theta) = E[grad_theta U_k(theta, z) | theta]``,
    the expectation under the client's conditional ``p(z | theta) ∝ exp(-U_k(theta, z))``
    estimated by self-normalised importance sampling from its Laplace approximation; and the
    effective size of the importance draws at each particle, as a fraction of their number (1:
    equal weights).

    Per particle the conditional's mode is found by damped Newton
    (:func:`~numpyro_fed.infer.stein.curvature.newton_modes`, from that particle's row of
    ``starts`` (``(N, d_l)``), in coordinates scaled by the spread of ``starts``); the proposal is
    ``N(mode, A^{-1})``, ``A`` the conditional's negative Hessian there (eigenvalues made
    positive), from the same standard normal draws at every particle
    (:func:`conditional_draws`: their first two moments exact). Where the conditional is
    Gaussian (a linear-Gaussian group effect, given the population's mean and scale) the
    weights are equal, and where ``grad_theta U_k`` is at most quadratic in ``z`` (a group
    effect's mean and scale, a Gaussian likelihood's) the estimate is exact; otherwise the
    weights correct the proposal.

    ``joint_value(theta, z) -> (S,)`` and ``joint_grads(theta, z) -> (g_theta, g_z)`` are
    ``U_k`` and its gradients at ``S`` pairs.

    >>> import jax, jax.numpy as jnp
    >>> # U(theta, z) = (z - theta)^2 / 2 + (1 - z)^2 / 2: L(theta) = (theta - 1)^2 / 4 + const
    >>> value = lambda t, z: 0.5 * ((z - t) ** 2 + (1 - z) ** 2).sum(-1)
    >>> grads = lambda t, z: (t - z, (z - t) - (1 - z))
    >>> g, ess = marginal_scores(jnp.array([[0.0], [3.0]]), jnp.zeros((2, 1)), value, grads, jax.random.PRNGKey(0))
    >>> [round(float(v), 3) for v in g[:, 0]], bool(ess.min() > 0.999)
    ([-0.5, 1.0], True)
    """
    laplace = conditional_laplace(theta, starts, joint_grads)
    eps = conditional_draws(rng_key, num_draws, starts.shape[1], theta.dtype)

    def one(t, mode, root):
        z, log_w = _proposed(laplace, t, mode, root, eps, joint_value)
        w = jax.nn.softmax(log_w)
        g_theta = joint_grads(jnp.broadcast_to(t, (z.shape[0], t.shape[0])), z)[0]
        ess = 1.0 / jnp.sum(w**2) / w.shape[0]
        return jnp.sum(w[:, None] * jnp.where(w[:, None] > 0, g_theta, 0.0), axis=0), ess

    return jax.vmap(one)(theta, laplace.modes, laplace.roots)


class ConditionalLaplace(NamedTuple):
    """Laplace approximations of a client's conditionals ``p(z | theta_n)``, one per global
    particle, in the coordinates ``u = (z - center) / scale``: ``z = center + scale * (mode_n +
    roots_n @ eps)`` for standard normal ``eps`` is a draw of ``N(mode, A^{-1})``."""

    center: jax.Array  # (d_l,)
    scale: jax.Array  # (d_l,)
    modes: jax.Array  # (N, d_l)
    roots: jax.Array  # (N, d_l, d_l), A^{-1/2}


def conditional_laplace(theta, starts, joint_grads) -> ConditionalLaplace:
    """The :class:`ConditionalLaplace` of a client's conditionals at the global particles
    ``theta`` (``(N, d_g)``): per particle damped Newton
    (:func:`~numpyro_fed.infer.stein.curvature.newton_modes`) from its row of ``starts``
    (``(N, d_l)``), in coordinates scaled by their spread, and the negative Hessian there
    (eigenvalues made positive). ``joint_grads(theta, z) -> (g_theta, g_z)`` at ``S`` pairs."""
    center = jnp.mean(starts, axis=0)
    spread = jnp.std(starts, axis=0)
    scale = jnp.where(spread > 0, spread, 1.0)

    def one(t, start):
        def score_u(u):  # the conditional's score in the scaled coordinates
            z = center + u * scale
            return -joint_grads(jnp.broadcast_to(t, (z.shape[0], t.shape[0])), z)[1] * scale

        ends, _ = newton_modes(score_u, ((start - center) / scale)[None], tolerance=CONVERGED_DECREMENT)

        def polish(u, _):  # a full Newton step: the search's line search on slopes halves a step
            # whose end has a slope of 0 up to round-off, so it converges only linearly there
            vectors, values = positive_curvature(score_u, u, 1e-10)
            new = u + ((score_u(u[None])[0] @ vectors) / values) @ vectors.T
            return jnp.where(jnp.all(jnp.isfinite(new)), new, u), None

        # from a converged search, to round-off: the same modes wherever the client's function
        # was compiled and however its search stopped
        mode, _ = lax.scan(polish, ends[0], None, length=POLISH_STEPS)
        vectors, values = positive_curvature(score_u, mode, 1e-10)
        return mode, (vectors / jnp.sqrt(values)) @ vectors.T

    modes, roots = jax.vmap(one)(theta, starts)
    return ConditionalLaplace(center, scale, modes, roots)


def _proposed(laplace: ConditionalLaplace, t, mode, root, eps, joint_value):
    """``(z (S, d_l), log_w (S,))``: the proposals ``eps`` (``(S, d_l)`` standard normal) of the
    conditional at the global point ``t`` and their importance log weights (``-inf`` where
    not finite)."""
    z = laplace.center + laplace.scale * (mode + eps @ root.T)
    log_w = -joint_value(jnp.broadcast_to(t, (z.shape[0], t.shape[0])), z) + 0.5 * jnp.sum(eps**2, axis=1)
    return z, jnp.where(jnp.isfinite(log_w), log_w, -jnp.inf)


def draw_conditionals(theta, starts, index, joint_value, joint_grads, rng_key, num_draws: int = CONDITIONAL_DRAWS):
    """``(S, d_l)``: one draw of the client's conditional ``p(z | theta_n)`` for each
    ``n`` of ``index`` (``(S,)`` indices of the global particles ``theta``), by importance
    resampling: ``num_draws`` proposals from its Laplace approximation
    (:func:`conditional_laplace`, from ``starts``), one kept with probability its weight. Exact
    where the conditional is Gaussian; otherwise the draws approach it as ``num_draws`` grows.

    >>> import jax, jax.numpy as jnp
    >>> value = lambda t, z: 0.5 * ((z - t) ** 2 + (1 - z) ** 2).sum(-1)  # z | t ~ N((t + 1) / 2, 1 / 2)
    >>> grads = lambda t, z: (t - z, (z - t) - (1 - z))
    >>> z = draw_conditionals(jnp.array([[3.0]]), jnp.zeros((1, 1)), jnp.zeros(4000, int), value, grads,
    ...                       jax.random.PRNGKey(0))
    >>> round(float(z.mean()), 1), round(float(z.var()), 1)
    (2.0, 0.5)
    """
    laplace = conditional_laplace(theta, starts, joint_grads)
    d_l = starts.shape[1]

    def one(args):
        n, key = args
        propose, pick = jax.random.split(key)
        eps = jax.random.normal(propose, (int(num_draws), d_l), theta.dtype)
        z, log_w = _proposed(laplace, theta[n], laplace.modes[n], laplace.roots[n], eps, joint_value)
        return z[jax.random.categorical(pick, log_w)]

    keys = jax.random.split(rng_key, index.shape[0])
    return lax.map(one, (index, keys), batch_size=min(int(index.shape[0]), 256))


class JointLocalState(NamedTuple):
    """What a DSVGD client keeps between its rounds in a model with client-local latents.

    :ivar local_particles: ``(N, d_g)``, the particles of ``p_0 t_k`` (global coordinates),
        as :class:`~numpyro_fed.infer.stein.dsvgd.LocalState`'s.
    :ivar latents: ``(N, d_l)``, the ``z_k`` halves of its joint particles (paired with the
        global particles by index; padding coordinates standard normal).
    :ivar visited: whether it has been scheduled before.
    """

    local_particles: jax.Array
    latents: jax.Array
    visited: jax.Array


def initial_local_states(particles, layout: LatentLayout, rng_key=None) -> JointLocalState:
    """Every client's :class:`JointLocalState` (stacked) from the initial ``(N, d)`` particles
    (public values the server drew from the init strategy): copies of their global halves,
    the client's own coordinates as its latent particles, its padding standard normal draws."""
    theta, z = layout.split(particles)
    key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    filler = jax.random.normal(key, z.shape, z.dtype)
    z = jnp.where(jnp.asarray(layout.valid)[:, None, :], z, filler)
    num_clients = layout.positions.shape[0]
    return JointLocalState(jnp.broadcast_to(theta, (num_clients,) + theta.shape), z, jnp.zeros(num_clients, bool))


def no_wider_cavity(local_u, u):
    """The client's particles of ``p_0 t_k`` (``local_u``, ``(N, d)``) in a round's
    coordinates, spread about their mean so that their covariance is at least that of ``q``'s
    particles ``u`` in every direction (``C_local - C_q`` positive semi-definite; with the
    round's full whitening ``C_q`` is the identity). Directions in which they are already as
    wide are left as they are.

    ``p_0 t_k`` is never narrower than ``q = p_0 t_k prod_{j != k} t_j`` where the other
    factors carry information, so a narrower set of particles is the noise of ``N`` particles
    (an sd from 20 particles is uncertain by 16 %). Both KDEs have kernels of 0.85 of their
    particles' covariance (:func:`~numpyro_fed.infer.stein.kde.kde_score_fn`), so in the
    tails the cavity ``q / (p_0 t_k)`` has precision ``(C_q^{-1} - C_local^{-1}) / 0.85^2``:
    negative in a direction where ``p_0 t_k``'s particles are narrower, the cavity then grows
    without bound along it, and where the client's own term is flat (a hierarchical scale in
    the client's latents: ``tau -> 0`` leaves each client's likelihood unchanged) the tilted
    distribution is improper and its particles run away. A per-coordinate sd is not enough:
    particles as wide as ``q``'s in each coordinate can be narrower along a diagonal (eight
    schools' ``mu`` and ``log tau`` ran away together, 313 posterior sds). Spread, the cavity
    is at worst flat in any direction for the round.

    >>> import jax, jax.numpy as jnp
    >>> u = jax.random.normal(jax.random.PRNGKey(0), (400, 2))
    >>> u = (u - u.mean(0)) @ jnp.linalg.inv(jnp.linalg.cholesky(jnp.cov(u.T, bias=True))).T
    >>> local = u @ jnp.array([[1.2, 1.1], [0.0, 0.3]])  # sds 1.2 and 1.14, but 0.17 along (1, -1)
    >>> c = no_wider_cavity(local, u)
    >>> bool(jnp.linalg.eigvalsh(jnp.cov(c.T, bias=True)).min() > 1 - 1e-6)
    True
    """
    dtype = local_u.dtype
    chol = whitening(u, full=True).chol  # q's covariance (with its ridge) -> I
    mean = jnp.mean(local_u, axis=0)
    w = jax.scipy.linalg.solve_triangular(chol, (local_u - mean).T, lower=True).T
    values, vectors = jnp.linalg.eigh(w.T @ w / w.shape[0])
    # a null direction (fewer particles than coordinates) cannot be spread
    spread = values > jnp.sqrt(jnp.finfo(dtype).eps) * jnp.max(values) + jnp.finfo(dtype).tiny
    stretch = jnp.where(spread & (values < 1.0), 1.0 / jnp.sqrt(jnp.where(spread, values, 1.0)), 1.0)
    w = ((w @ vectors) * stretch) @ vectors.T
    return mean + w @ chol.T


def _identity_frame(theta) -> Whitening:
    d = theta.shape[-1]
    return Whitening(jnp.zeros(d, theta.dtype), jnp.eye(d, dtype=theta.dtype))


def refresh_latents(theta, latents, latent_score: Callable, num_steps: int, optim, bandwidth=None, stages: int = 1):
    """The latent particles ``latents`` (``(N, d_l)``) moved by ``num_steps`` SVGD steps towards
    ``p(z | theta_n)`` given their partners ``theta`` (``(N, d_g)``, fixed):
    ``latent_score(theta, z) -> (N, d_l)`` is ``grad_z log p(theta, z)``. The kernel is on the
    joint coordinates, the direction kept in ``z``: for any ``theta``-marginal, the fixed
    points are the pairs whose conditional is ``p(z | theta)``. In ``stages`` stages, each
    per coordinate whitened (so a step in ``z`` stays one in ``z``).

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.infer.stein import adagrad_momentum
    >>> theta = jax.random.normal(jax.random.PRNGKey(0), (100, 1))
    >>> z = refresh_latents(theta, jnp.zeros((100, 1)) + jnp.linspace(-1, 1, 100)[:, None],
    ...                     lambda t, z: -(z - 2.0 * t), 400, adagrad_momentum(0.1), stages=4)
    >>> # z | theta ~ N(2 theta, 1): the pairs' correlation is 2 / sqrt(5) = 0.894 (measured: 0.888)
    >>> bool(abs(jnp.corrcoef(theta[:, 0], z[:, 0])[0, 1] - 2 / 5**0.5) < 0.05)
    True
    """
    d_g = theta.shape[1]
    u = whitening(theta, full=False).to_z(theta)

    def stage(z, size):
        w = whitening(z, full=False)

        def step(carry, _):
            v, opt_state = carry
            score = w.score_to_z(latent_score(theta, w.from_z(v)))
            phi = svgd_direction(jnp.concatenate([u, v], 1), jnp.concatenate([jnp.zeros_like(u), score], 1), bandwidth)
            updates, opt_state = optim.update(-phi[:, d_g:], opt_state, v)
            return (v + updates, opt_state), None

        v = w.to_z(z)
        (v, _), _ = lax.scan(step, (v, optim.init(v)), None, length=size)
        return w.from_z(v)

    stages = max(1, min(int(stages), int(num_steps)))
    length, remainder = divmod(int(num_steps), stages)
    latents, _ = lax.scan(lambda z, _: (stage(z, length), None), latents, None, length=stages)
    return stage(latents, remainder) if remainder else latents


def joint_gradients(client_grad: Callable, layout: LatentLayout) -> Callable:
    """``(theta (N, d_g), z (N, d_l), block) -> (g_theta, g_z)``: the gradients of the
    client's term ``U_k`` (``client_grad``, batched on full ``(N, d)`` points) in ``theta``
    and in its own coordinates ``z`` at every pair; a padding coordinate gets a standard
    normal's. The client is ``block["client"]``."""
    positions_of, valid_of = jnp.asarray(layout.positions), jnp.asarray(layout.valid)
    global_index = jnp.asarray(layout.global_index)

    def joint_grads(theta, z, block):
        positions, valid = positions_of[block["client"]], valid_of[block["client"]]
        g = client_grad(embed(theta, z, positions, layout), block, None)
        g_z = jnp.take(g, positions, axis=1, mode="fill", fill_value=0)
        return g[:, global_index], jnp.where(valid, g_z, z)

    return joint_grads


def joint_potential(client_potential: Callable, layout: LatentLayout) -> Callable:
    """``(theta (N, d_g), z (N, d_l), block) -> (N,)``: the client's term ``U_k`` at every pair
    (``client_potential``: ``((d,), block) -> ()``), plus a standard normal's for each padding
    coordinate (as :func:`joint_gradients`)."""
    positions_of, valid_of = jnp.asarray(layout.positions), jnp.asarray(layout.valid)
    value = jax.vmap(client_potential, in_axes=(0, None))

    def joint_value(theta, z, block):
        positions, valid = positions_of[block["client"]], valid_of[block["client"]]
        padding = 0.5 * jnp.sum(jnp.where(valid, 0.0, z**2), axis=-1)
        return value(embed(theta, z, positions, layout), block) + padding

    return joint_value


def client_functions(
    prior_grad: Callable,
    client_grad: Callable,
    layout: LatentLayout,
    *,
    num_local_steps: int,
    num_distill_steps: int,
    optim,
    distill_optim=None,
    kde_bandwidth="auto",
    svgd_bandwidth=None,
    temperature: float = 1.0,
    client_potential: Callable | None = None,
) -> tuple[dict, dict]:
    """What a DSVGD client of a model with client-local latents runs, ``(functions,
    stateful)`` as a :class:`~numpyro_fed.federation.ClientProgram` takes them, on its own
    :class:`JointLocalState`:

    * ``"update"``: ``(block, local, global_particles, first) -> (local', new global
      particles)``, one round (the same messages as
      :func:`~numpyro_fed.infer.stein.dsvgd.client_functions`'): the joint SVGD steps, the
      distillation of ``t_k``; the latent halves stay;
    * ``"latents"``: ``(block, local, global_particles) -> (local, latents)``, a latent
      partner for each global particle (the client's state unchanged): given
      ``client_potential`` (``((d,), block) -> ()``, the value of the client's term), a draw
      of its conditional ``p(z_k | theta_n)`` (:func:`draw_conditionals`); without it, its
      latent particles refreshed for them (:func:`refresh_latents`);
    * given ``client_potential``, ``"draw_latents"``: ``(block, local, global_particles,
      index, key) -> (local, draws)``, a draw of the conditional for each global particle
      ``index`` names (what :meth:`DSVGD.get_samples
      <numpyro_fed.infer.stein.methods.DSVGD.get_samples>` returns for the local sites), and
      ``"marginal_score"``: ``(block, local, global_particles) -> (local, (scores, ess))``,
      the gradient of its marginal term ``L_k`` at each global particle and the importance
      draws' effective size as a fraction of their number (:func:`marginal_scores`), what
      Stein's check and moment correction of the global particles use.

    ``prior_grad`` and ``client_grad`` are the full-space gradients of
    :func:`~numpyro_fed.infer.stein.model.flat_gradients`; the other options as
    :func:`~numpyro_fed.infer.stein.dsvgd.build_client`.
    """
    distill_optim = optim if distill_optim is None else distill_optim
    config = round_config(global_prior_grad(prior_grad, layout), client_grad, None, kde_bandwidth, svgd_bandwidth)
    kde_score = kde_score_fn(config.kde_bandwidth)
    joint_grads, d_g = joint_gradients(config.client_grad, layout), layout.num_global
    joint_value = None if client_potential is None else joint_potential(client_potential, layout)

    def latent_score(block):
        return lambda theta, z: -joint_grads(theta, z, block)[1] / temperature

    def tempered(block):  # the client's tempered term at pairs and its gradients
        def value(theta, z):
            return joint_value(theta, z, block) / temperature

        def grads(theta, z):
            return tuple(g / temperature for g in joint_grads(theta, z, block))

        return value, grads

    def marginal_score(block, local: JointLocalState, global_particles):
        key = jax.random.fold_in(jax.random.PRNGKey(0), block["client"])  # common draws: a smooth score
        g, ess = marginal_scores(global_particles, local.latents, *tempered(block), key)
        return local, (g, ess)

    def update(block, local: JointLocalState, global_particles, first):
        def own_posterior_score(y):  # p_0(theta) exp(-U_k(theta, z) / alpha)
            g_theta, g_z = joint_grads(y[:, :d_g], y[:, d_g:], block)
            return jnp.concatenate([config.prior_score(y[:, :d_g]) - g_theta / temperature, -g_z / temperature], 1)

        y = jnp.concatenate([global_particles, local.latents], 1)
        if config.curvature:  # the run's first round starts from the Laplace approximation, if there is a mode
            y = lax.cond(first, lambda y: laplace_start(y, own_posterior_score, require_mode=True), lambda y: y, y)
        theta = y[:, :d_g]
        frame = whitening(theta) if config.kde_bandwidth == "auto" else _identity_frame(theta)

        def prior_score(u):
            return frame.score_to_z(config.prior_score(frame.from_z(u)))

        u = frame.to_z(theta)
        local_u = frame.to_z(local.local_particles)
        if config.kde_bandwidth == "auto":
            local_u = no_wider_cavity(local_u, u)
        score_previous, score_local = round_scores(
            u, local_u, prior_score, kde_score, visited=local.visited, first=first
        )

        def tilted_score(y):  # Eq. (14) in theta, the client's own term in z
            v = y[:, :d_g]
            g_theta, g_z = joint_grads(frame.from_z(v), y[:, d_g:], block)
            s_theta = score_previous(v) - score_local(v) + prior_score(v) - frame.score_to_z(g_theta) / temperature
            return jnp.concatenate([s_theta, -g_z / temperature], 1)

        y = staged_svgd(
            jnp.concatenate([u, y[:, d_g:]], 1),
            tilted_score,
            num_local_steps,
            optim,
            config.svgd_bandwidth,
            None,
            config.stages,
            config.curvature,
        )
        new_u, latents = y[:, :d_g], y[:, d_g:]
        distill_previous = score_previous
        if config.kde_bandwidth == "auto":
            # the distillation's q^(i-1) from particles no narrower than q^(i)'s in any direction
            # (no_wider_cavity's spread, the other way round): its target c_k t_k q^(i) / q^(i-1)
            # is a ratio of KDEs that grows without bound along a direction where q^(i) came out
            # wider, and a client's particles of c_k t_k ran away along it (log sigma at -40 in a
            # client's first distillation on a centred random-intercept model)
            distill_previous = round_scores(
                no_wider_cavity(u, new_u), local_u, prior_score, kde_score, visited=local.visited, first=first
            )[0]
        new_local_u = distill(
            new_u,
            local_u,
            distill_previous,
            score_local,
            kde_score=kde_score,
            num_distill_steps=num_distill_steps,
            distill_optim=distill_optim,
            svgd_bandwidth=config.svgd_bandwidth,
            visited=local.visited,
            stages=config.stages,
            curvature=config.curvature,
        )
        new_local = JointLocalState(frame.from_z(new_local_u), latents, jnp.ones_like(local.visited))
        return new_local, frame.from_z(new_u)

    def draw_latents(block, local: JointLocalState, global_particles, index, key):
        key = jax.random.fold_in(key, block["client"])
        return local, draw_conditionals(global_particles, local.latents, index, *tempered(block), key)

    def latents(block, local: JointLocalState, global_particles):
        if joint_value is not None:  # a draw of the conditional at each global particle
            index = jnp.arange(global_particles.shape[0])
            return draw_latents(block, local, global_particles, index, jax.random.PRNGKey(1))
        refreshed = refresh_latents(
            global_particles,
            local.latents,
            latent_score(block),
            num_local_steps,
            optim,
            config.svgd_bandwidth,
            config.stages,
        )
        return local, refreshed

    stateful = {"update": update, "latents": latents}
    if joint_value is not None:
        stateful.update(marginal_score=marginal_score, draw_latents=draw_latents)
    return {}, stateful


def init(particles, layout: LatentLayout, federation):
    """The :class:`~numpyro_fed.infer.stein.dsvgd.DSVGDState` of Algorithm 1, line 1, from the
    initial ``(N, d)`` particles: the server keeps their global halves, every client gets its
    :class:`JointLocalState` through the federation's ``init_state``."""
    from numpyro_fed.infer.stein.dsvgd import DSVGDState

    num_clients = federation.num_clients
    return DSVGDState(
        global_particles=layout.split(particles)[0],
        clients=federation.init_state(initial_local_states(particles, layout)),
        visited=jnp.zeros(num_clients, bool),
        round=jnp.zeros((), jnp.int32),
        absent=jnp.zeros(num_clients, bool),
    )
