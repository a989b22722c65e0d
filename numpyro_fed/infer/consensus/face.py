"""The face of consensus Monte Carlo: :class:`ConsensusMC`."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer import NUTS
from numpyro.infer.initialization import init_to_median

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.infer.base import ClientSpec, RunResult, VariationalMethod, jit_round, ledger_stats
from numpyro_fed.infer.consensus.checks import agreement, warn_untrustworthy
from numpyro_fed.infer.consensus.core import (
    SubposteriorSummary,
    consensus_combine,
    make_client_run,
    parametric_combine,
)
from numpyro_fed.infer.stein.local import check_own_latents, latent_layout

__all__ = ["ConsensusMC", "ConsensusState"]

COMBINES = ("consensus", "parametric")


class ConsensusState(NamedTuple):
    """A :class:`ConsensusMC` run's state (unconstrained global coordinates ``theta``).

    :ivar draws: ``(num_chains * num_samples, d_g)`` consensus draws (``combine="consensus"``;
        ``None`` for ``"parametric"``).
    :ivar mean: ``(d_g,)`` the combined posterior's mean.
    :ivar cov: ``(d_g, d_g)`` its covariance.
    :ivar clients: the clients' replies, a
        :class:`~numpyro_fed.infer.consensus.core.SubposteriorSummary` stacked on a leading
        axis ``M``.
    :ivar local: the :class:`~numpyro_fed.federation.ClientState` holding each client's draws
        of its own latent coordinates (kept where the client lives), or ``None``.
    """

    draws: Any
    mean: Any
    cov: Any
    clients: Any
    local: Any


class _Plan(NamedTuple):
    step: Any
    start: Any
    prior_weights: Any
    positions: Any
    valid: Any
    global_index: Any
    coordinate_names: list


class ConsensusMC(VariationalMethod):
    """Consensus Monte Carlo (Scott et al. 2016; Neiswanger, Wang & Xing 2014): one round.

    Every client runs MCMC (NUTS by default) on its sub-posterior, the prior raised to
    ``w_m`` (``1/M``) times its own rows' likelihood, where it lives; it sends its draws of the
    global latent variables (``combine="consensus"``) or only their mean and covariance
    (``"parametric"``), and the server combines them:

    * ``"consensus"``: Scott et al.'s draws, each the precision-weighted average of one draw
      of every client (the weights: each client's expected Hessian over its draws, or the
      inverse of its sample covariance where that Hessian does not describe them; see
      ``docs/guide/consensus.md``);
    * ``"parametric"``: Neiswanger et al.'s product of the clients' Gaussian approximations.

    Both are exact when the sub-posteriors are Gaussian (a linear-Gaussian model) and close
    when every client holds enough rows for its sub-posterior to be nearly Gaussian; with small
    clients or skewed sub-posteriors they are biased, and the run warns
    (:class:`~numpyro_fed.infer.consensus.checks.ConsensusWarning`, with the statistic: the
    worst skewness or kurtosis, or the squared Mahalanobis distance of a client's mean from
    the combination). The combination happens on the unconstrained space (a HalfCauchy
    scale's logarithm); draws come back constrained.

    Client-local latent variables (sites in a federated plate of clients): each client samples
    its own with the global ones and keeps its draws (its client state); only the global
    coordinates cross. :meth:`get_samples` returns the global sites.

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`.
    :param str combine: ``"consensus"`` or ``"parametric"``.
    :param int num_warmup: each client's adaptation steps.
    :param int num_samples: each chain's draws.
    :param int num_chains: chains per client (run together, ``vmap``-ped).
    :param kernel: a NumPyro kernel class built as ``kernel(potential_fn=..., **kernel_kwargs)``
        (``NUTS``, ``HMC``, ``BarkerMH``, ...).
    :param dict kernel_kwargs: its options (e.g. ``{"target_accept_prob": 0.9}``).
    :param preconditioner: ``"laplace"`` (default): each client first finds its sub-posterior's
        mode (damped Newton steps on its own rows) and runs the kernel in the coordinates in
        which the Laplace approximation there is a standard normal, its chains starting at the
        mode; the draws are mapped back. Coefficients of raw covariates (posterior sds of
        1e-4 and less beside others near 1) then cost NUTS a few leapfrog steps per draw
        instead of hundreds. Where the search finds no mode (a funnel) that client's kernel
        runs in the model's coordinates from ``init_strategy``'s point. ``None``: always so.
        A ``kernel_kwargs`` mass matrix or step size is in the preconditioned coordinates.
    :param prior_split: the prior's power per client: ``"equal"`` (``1/M``), ``"size"``
        (proportional to the clients' rows) or ``M`` non-negative weights summing to 1.
    :param partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: where the chains start (default ``init_to_median``).
    :param federation: the backend (default in process: every client's chains in one
        compiled program).
    :param float timeout: on an engine, the seconds each client's run (its compilation and
        all its chains) may take before the run stops with a
        :class:`~numpyro_fed.federation.ClientError` naming it; it replaces the federation's
        own ``timeout``, which bounds one round of the iterative methods. A worker that dies
        is reported when the others have answered, without waiting this long.

    **Example**

    .. doctest::

        >>> import jax, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with nf.federated_plate("data", y.shape[0], clients=4):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> y = 3.0 + jax.random.normal(jax.random.PRNGKey(1), (200,))
        >>> cmc = nf.ConsensusMC(model, num_warmup=100, num_samples=300, progress_bar=False)
        >>> result = cmc.run(jax.random.PRNGKey(0), y)
        >>> draws = cmc.get_samples(jax.random.PRNGKey(1), result, 100)
        >>> draws["mu"].shape, bool(abs(draws["mu"].mean() - y.mean()) < 0.1)
        ((100,), True)
    """

    repr_fields = ("combine", "num_warmup", "num_samples", "num_chains")
    divergence_advice = "increase num_warmup, or check the model's sub-posteriors are proper"

    def __init__(
        self,
        model,
        *,
        combine: str = "consensus",
        num_warmup: int = 500,
        num_samples: int = 1000,
        num_chains: int = 1,
        kernel=NUTS,
        kernel_kwargs: dict | None = None,
        preconditioner: str | None = "laplace",
        prior_split="equal",
        partition=None,
        init_strategy=init_to_median,
        progress_bar: bool = True,
        federation=None,
        timeout: float = 3600.0,
    ):
        super().__init__(
            model, partition=partition, init_strategy=init_strategy, progress_bar=progress_bar, federation=federation
        )
        if combine not in COMBINES:
            extra = (
                " (the semiparametric combination is not provided: its kernel density product is not robust "
                "in more than a few dimensions)"
                if combine == "semiparametric"
                else ""
            )
            raise ValueError(f"combine must be one of {COMBINES}, not {combine!r}{extra}")
        self.combine = combine
        self.num_warmup = check_int(num_warmup, "num_warmup", minimum=1)
        self.num_samples = check_int(num_samples, "num_samples", minimum=8)
        self.num_chains = check_int(num_chains, "num_chains", minimum=1)
        if not callable(kernel):
            raise TypeError(f"kernel must be a NumPyro kernel class (e.g. NUTS), got {type(kernel).__name__}")
        if preconditioner not in ("laplace", None):
            raise ValueError(f"preconditioner must be 'laplace' or None, not {preconditioner!r}")
        self.preconditioner = preconditioner
        self.kernel = kernel
        self.kernel_kwargs = dict(kernel_kwargs or {})
        try:
            kernel(potential_fn=lambda y: jnp.sum(y**2), **self.kernel_kwargs)
        except TypeError as error:
            raise TypeError(
                f"kernel={getattr(kernel, '__name__', kernel)!r} with kernel_kwargs={self.kernel_kwargs} cannot be "
                f"built as kernel(potential_fn=..., **kernel_kwargs): {error}"
            ) from None
        if isinstance(prior_split, str) and prior_split not in ("equal", "size"):
            raise ValueError(f"prior_split must be 'equal', 'size' or M weights summing to 1, not {prior_split!r}")
        self.prior_split = prior_split
        self.timeout = check_positive(timeout, "timeout")
        self._plan = None

    # -- the clients -------------------------------------------------------------------------
    def _prior_weights(self, fp) -> np.ndarray:
        m = fp.num_clients
        if isinstance(self.prior_split, str):
            sizes = np.asarray(fp.client_sizes, float)
            return np.full(m, 1.0 / m) if self.prior_split == "equal" else sizes / sizes.sum()
        weights = np.asarray(self.prior_split, float)
        if weights.shape != (m,) or (weights < 0).any() or not np.isclose(weights.sum(), 1.0):
            raise ValueError(
                f"prior_split must be {m} non-negative weights summing to 1 (one per client), got {weights.tolist()}"
            )
        return weights

    def plan_clients(self, rng_key, args, kwargs, *, num_rounds=None) -> ClientSpec:
        """Splits the model and returns the clients' program: ``"subposterior"`` (its
        sub-posterior's MCMC run and summary, see
        :func:`~numpyro_fed.infer.consensus.core.make_client_run`), a stateful call when the
        model has client-local latents (the client keeps their draws)."""
        fp = self.build_potential(args, kwargs, global_latents_only=False)
        flat = fp.flat()
        layout = latent_layout(fp)
        owner = np.asarray(fp.coordinate_owner)
        global_index = np.flatnonzero(owner < 0).astype(np.int32)
        if global_index.size == 0:
            raise ValueError("ConsensusMC combines global latent variables; this model has none outside its plates")
        if layout is not None:
            x0 = fp.ravel(fp.init_params)
            check_own_latents(fp, layout, jax.grad(flat.client_potential), x0)
        kernel, options = self.kernel, self.kernel_kwargs
        run = make_client_run(
            flat.prior_potential,
            flat.client_potential,
            num_latent=fp.num_latent,
            global_index=global_index,
            kernel_factory=lambda potential: kernel(potential_fn=potential, **options),
            num_warmup=self.num_warmup,
            num_samples=self.num_samples,
            num_chains=self.num_chains,
            send_draws=self.combine == "consensus",
            precondition=self.preconditioner == "laplace",
        )
        timeouts = {"subposterior": self.timeout}  # the call is the client's whole run
        if layout is None:
            return ClientSpec({"subposterior": lambda block, *a: run(block, *a)[1]}, timeouts=timeouts)

        def stateful(block, kept, *a):  # the client's own latent draws stay where it lives
            return run(block, *a)

        return ClientSpec({}, stateful={"subposterior": stateful}, timeouts=timeouts)

    def init(self, rng_key, *args, **kwargs) -> ConsensusState:
        """Splits the model on its arguments (the data), starts the clients and returns the
        state before the round."""
        spec = self.plan_clients(rng_key, args, kwargs)
        federation = self.start_clients(**spec._asdict())
        fp = self.federated_potential
        layout = latent_layout(fp)
        global_index = np.flatnonzero(np.asarray(fp.coordinate_owner) < 0).astype(np.int32)
        x0 = np.asarray(fp.ravel(fp.init_params))
        m = fp.num_clients
        if layout is None:
            positions = np.full((m, 0), fp.num_latent, np.int32)
            valid = np.zeros((m, 0), bool)
        else:
            positions, valid = np.asarray(layout.positions), np.asarray(layout.valid)
        own = np.where(valid, np.concatenate([x0, [0.0]])[positions], 0.0)
        start = np.concatenate([np.broadcast_to(x0[global_index], (m, global_index.size)), own], axis=1)
        local = None
        if layout is not None:
            draws = self.num_chains * self.num_samples
            local = federation.init_state(jnp.zeros((m, draws, positions.shape[1]), x0.dtype))
        combine = self.combine
        weights = self._prior_weights(fp).astype(x0.dtype)

        def step(rng_key, state, federation):
            keys = jax.random.split(rng_key, m)
            per_client = (keys, start.astype(x0.dtype), weights, positions, valid)
            if state.local is None:
                replies, kept = federation.map("subposterior", per_client=per_client), None
            else:
                kept, replies = federation.map("subposterior", per_client=per_client, state=state.local)
            if combine == "consensus":
                draws = consensus_combine(replies.draws, replies.precision)
                mean, cov = jnp.mean(draws, axis=0), jnp.atleast_2d(jnp.cov(draws, rowvar=False))
            else:
                draws, (mean, cov) = None, parametric_combine(replies.mean, precisions=replies.precision)
            return ConsensusState(draws, mean, cov, replies, kept), None

        names = [fp.coordinate_names[i] for i in global_index]
        self._plan = _Plan(jit_round(step), start, weights, positions, valid, global_index, names)
        return ConsensusState(None, None, None, None, local)

    def update(self, rng_key, state: ConsensusState, *args, **kwargs):
        """The round: every client's run and the server's combination, ``(state, None)``."""
        with self._active_federation.guard():
            return self._plan.step(rng_key, state, self._active_federation)

    def run(self, rng_key, *args, init_state=None, **kwargs) -> RunResult:
        """Runs the round on the model's arguments ``args``, ``kwargs`` (the data; none in
        deployment, where a leading ``1``, the number of rounds every method's run on Flower
        passes, is accepted). ``init_state`` is ignored (a run is one round: it is re-run).

        :return: a :class:`~numpyro_fed.infer.RunResult`: ``state`` a :class:`ConsensusState`,
            ``metrics`` every client's diagnostics (leading axes: the round, the client), the
            ledger.
        """
        if self.federation.deployed and len(args) == 1 and not kwargs and np.ndim(args[0]) == 0:
            if int(args[0]) != 1:
                raise ValueError(f"ConsensusMC runs one round, not {args[0]}")
            args = ()
        key_init, key_run = jax.random.split(rng_key)
        state = self.init(key_init, *args, **kwargs)
        result = self.drive(self.update, key_run, state, 1, is_finite=self._finite, desc="ConsensusMC")
        return self.finish(result)

    @staticmethod
    def _finite(state) -> bool:
        return bool(np.isfinite(np.asarray(state.mean)).all() and np.isfinite(np.asarray(state.cov)).all())

    # -- results ---------------------------------------------------------------------------
    def record(self, state: ConsensusState, info) -> dict:
        replies: SubposteriorSummary = state.clients
        if self.combine == "consensus":
            draws = np.asarray(replies.draws)
            means = draws.mean(axis=1)
            covs = np.stack([np.atleast_2d(np.cov(d, rowvar=False)) for d in draws])
        else:
            means, covs = np.asarray(replies.mean), np.asarray(replies.cov)
        distance_sq, p_value = agreement(means, covs, np.asarray(state.mean))
        out = {
            name: np.asarray(getattr(replies, name))
            for name in SubposteriorSummary._fields[4:]  # refined and the diagnostics
        }
        out.update(client_mean=means, distance_sq=distance_sq, p_agreement=p_value)
        return out

    def finish(self, result: RunResult) -> RunResult:
        """Warns where the combination is not to be trusted (see
        :func:`~numpyro_fed.infer.consensus.checks.warn_untrustworthy`)."""
        warn_untrustworthy({k: v[0] for k, v in result.metrics.items()}, self._plan.coordinate_names, stacklevel=4)
        return result

    def get_samples(self, rng_key, result: RunResult, num_samples: int | None = None) -> dict:
        """Constrained draws of the global sites, by site: ``"consensus"``, ``num_samples`` of
        the run's consensus draws chosen at random (all of them, in order, by default);
        ``"parametric"``, draws of the combined Gaussian (default ``num_chains *
        num_samples``)."""
        state: ConsensusState = result.state
        total = self.num_chains * self.num_samples
        if self.combine == "consensus":
            theta = jnp.asarray(state.draws)
            if num_samples is not None:
                num_samples = check_int(num_samples, "num_samples", minimum=1)
                if num_samples > total:
                    raise ValueError(
                        f"num_samples={num_samples}: the run made {total} consensus draws (one per draw of "
                        f"each client's chains): ask for at most {total}, or construct ConsensusMC with more "
                        "num_samples or num_chains; combine='parametric' draws any number from its Gaussian"
                    )
                theta = theta[jax.random.choice(rng_key, total, (num_samples,), replace=False)]
        else:
            num_samples = total if num_samples is None else check_int(num_samples, "num_samples", minimum=1)
            mean, cov = jnp.asarray(state.mean), jnp.asarray(state.cov)
            noise = jax.random.normal(rng_key, (num_samples, mean.shape[0]), mean.dtype)
            theta = mean + noise @ jnp.linalg.cholesky(cov).T
        return self.constrained(theta)

    def constrained(self, theta) -> dict:
        """The global sites, constrained, of ``(S, d_g)`` unconstrained global coordinates."""
        fp, plan = self.federated_potential, self._plan
        x = jnp.zeros((theta.shape[0], fp.num_latent), theta.dtype).at[:, plan.global_index].set(theta)
        values = jax.vmap(fp.flat().postprocess)(x)
        keep = [n for n, o in fp.coordinate_owner_tree.items() if (np.asarray(o) < 0).all()]
        return {name: values[name] for name in keep}

    def arviz_dicts(self, result: RunResult, *, num_samples: int | None = None, rng_key=None) -> dict:
        """``posterior``: one chain of :meth:`get_samples`; ``sample_stats``: every client's
        sub-posterior diagnostics (dims ``client`` and ``coordinate``, a global coordinate's
        name), the agreement statistics and the message ledger; ``attrs``."""
        from numpyro_fed.arviz import federation_attrs

        rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        draws = self.get_samples(rng_key, result, num_samples)
        posterior = {k: np.asarray(v)[None] for k, v in draws.items()}
        sample_stats = {}
        for name, value in result.metrics.items():
            value = np.asarray(value)[0]
            if name == "wall_time":
                continue
            sample_stats[name] = (value, ["client", "coordinate"][: value.ndim])
        sample_stats.update(ledger_stats(result.ledger))
        coords = {"client": np.arange(self.federated_potential.num_clients), "coordinate": self._plan.coordinate_names}
        attrs = {"algorithm": "ConsensusMC", "federation": type(self.federation).__name__}
        attrs.update({name: getattr(self, name) for name in self.repr_fields})
        attrs.update(federation_attrs(self.federated_potential))
        dims = dict(self.federated_potential.site_dims)
        return {"posterior": posterior, "sample_stats": sample_stats, "coords": coords, "attrs": attrs, "dims": dims}
