"""The baselines of the DP-PVI paper, as :class:`~numpyro_fed.DPPVI` with fixed settings:
:class:`BCM` (one round, the server multiplies the clients' local posteriors) and
:class:`GlobalVI` (DP-SGD on the pooled rows through a trusted aggregator)."""

from __future__ import annotations

import numpy as np

from numpyro_fed._checks import check_int
from numpyro_fed.infer.base import ClientSpec, RunResult
from numpyro_fed.infer.pvi.baseline_core import committee_init, committee_posterior, pooled_client_data
from numpyro_fed.infer.pvi.dppvi import DPPVI
from numpyro_fed.infer.pvi.gaussian import as_full

__all__ = ["BCM", "GlobalVI"]


class BCM(DPPVI):
    """Bayesian committee machine (Tresp 2000) trained with DP-SGD: the one-round baseline
    of the DP-PVI paper. Every client fits its local posterior once, from the prior
    (``prior="same"``: ``q = prod_m q_m / p^(M-1)``) or from ``p^(1/M)``
    (``prior="split"``: ``q = prod_m q_m``); the server multiplies them.

    It is DPPVI with one synchronous round, no damping: ``run(rng_key, 1, *args)`` (one
    round is all there is). The privacy is that of ``num_local_steps`` DP-SGD steps per
    client. Other arguments as :class:`~numpyro_fed.DPPVI` (``dp`` is ``"dpsgd"`` or
    ``None``), ``federation`` and deployment (``loader=``) too.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> bcm = nf.BCM(model, prior="split", dp=None, num_local_steps=300, progress_bar=False)
    >>> result = bcm.run(jax.random.PRNGKey(0), 1, jnp.ones(8))
    >>> params = bcm.get_params(result.state)
    >>> loc, scale = params["loc"]["mu"], params["scale"]["mu"]
    >>> bool(abs(loc - 8 / 9) < 0.05 and abs(scale - 1 / 3) < 0.03)  # the exact posterior
    True
    """

    repr_fields = ("prior", "dp", "num_local_steps", "num_mc_samples")

    def __init__(self, model, *, prior: str = "same", dp: str | None = "dpsgd", **kwargs):
        if prior not in ("same", "split"):
            raise ValueError(f"prior must be 'same' or 'split', got {prior!r}")
        if dp not in (None, "dpsgd"):
            raise ValueError(f"BCM trains with DP-SGD: dp must be 'dpsgd' or None, got {dp!r}")
        for name in ("schedule", "damping"):
            if name in kwargs:
                raise ValueError(f"BCM fixes {name}: one synchronous round, no damping")
        self.prior = prior
        kwargs.setdefault("covariance", "diagonal")  # the paper's mean-field baseline
        super().__init__(model, dp=dp, schedule="synchronous", damping=1.0, **kwargs)

    def _initial_state(self, prior, num_clients):
        if not prior.exact:
            raise ValueError(
                "BCM multiplies local posteriors fitted from a Gaussian prior: this model's prior is not a "
                "proper Gaussian with independent coordinates on the unconstrained space (e.g. a HalfCauchy "
                "scale or a flat prior); use DPPVI, which refines such a prior as a factor of its own"
            )
        base = as_full(prior.base) if self.full_rank(prior.base.eta1.shape[-1]) else prior.base
        return committee_init(base, num_clients, self.prior, federation=self._plan.federation)

    def _final_state(self, state):
        return committee_posterior(state)

    def run(self, rng_key, num_rounds: int, *args, **kwargs) -> RunResult:
        """As :meth:`DPPVI.run <numpyro_fed.DPPVI.run>`; ``num_rounds`` must be 1."""
        if check_int(num_rounds, "num_rounds", minimum=1) != 1:
            raise ValueError(
                f"BCM runs one round (the server multiplies the local posteriors once), got num_rounds={num_rounds}"
            )
        if kwargs.get("init_state") is not None:
            raise ValueError("BCM runs one round from the prior: init_state does not apply")
        return super().run(rng_key, 1, *args, **kwargs)


class GlobalVI(DPPVI):
    """Global (centralized) DP-VI with a trusted aggregator (Jälkö et al. 2017): the
    baseline of the DP-PVI paper that needs a communication per optimization step.

    Every step, each client sends its sum of clipped per-example gradients to a trusted
    aggregator that adds the noise once: the same as DP-SGD on the pooled rows, which is
    how it is computed here. A round is ``num_local_steps`` steps (the paper's run is one
    round); the communications count ``M`` per step. Other arguments as
    :class:`~numpyro_fed.DPPVI`. It pools the clients' rows (the trusted aggregator is
    emulated by one party): it refuses deployment (a federation with ``loader=``) with a
    ``ValueError``.
    """

    repr_fields = ("dp", "num_local_steps", "num_mc_samples")

    def __init__(self, model, *, dp: str | None = "dpsgd", **kwargs):
        if dp not in (None, "dpsgd"):
            raise ValueError(f"GlobalVI trains with DP-SGD: dp must be 'dpsgd' or None, got {dp!r}")
        for name in ("schedule", "damping"):
            if name in kwargs:
                raise ValueError(f"GlobalVI fixes {name}")
        kwargs.setdefault("covariance", "diagonal")  # the paper's mean-field baseline
        super().__init__(model, dp=dp, schedule="synchronous", damping=1.0, **kwargs)

    def _layout(self, potential, plate):
        if potential.deployed:
            raise ValueError(
                f"GlobalVI pools every client's rows through a trusted aggregator, emulated in one "
                f"party here: it cannot run in deployment (federation={self.federation!r}: the rows "
                "stay on the clients). Run it in simulation on the pooled data, GlobalVI(model, "
                "...).run(rng_key, num_rounds, *data), or use DPPVI, which runs in deployment"
            )
        valid = potential.client_data["valid"][plate]
        return np.array([int(np.sum(valid))]), int(valid.size)

    def _client_spec(self, programs, potential, layout):
        # one party holding the pooled rows (simulation only, see _layout)
        functions, stateful = programs
        return ClientSpec(functions, pooled_client_data(potential.client_data, layout), stateful=stateful)

    def _communications_per_round(self):
        return self.federated_potential.num_clients * self.num_local_steps
