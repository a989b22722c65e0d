"""One accessor for what crossed the wire in any run: :func:`message_ledger`.

Every algorithm counts its messages in the shape of :meth:`MessageLedger.summary
<numpyro_fed.federation.MessageLedger.summary>`: ``{name: (M,) array}`` per client (or agent),
totals (``messages_to_client``, ``bytes_to_client``, ``messages_from_client``,
``bytes_from_client``, ``messages_to_peer``, ``bytes_to_peer``, ``rounds``) and the same per
call, prefixed ``"<call>/"``. A sampler's run is an ``MCMC`` object whose kernel knows how to
count it (:meth:`FederatedMCMCKernel.message_ledger
<numpyro_fed.infer.kernel.FederatedMCMCKernel.message_ledger>`); a variational run's
:class:`~numpyro_fed.infer.RunResult` carries its ledger.

>>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
>>> import numpyro_fed as nf
>>> def model(y):
...     mu = numpyro.sample("mu", dist.Normal(0, 3))
...     with nf.federated_plate("data", y.shape[0], clients=3):
...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
>>> result = nf.DPPVI(model, progress_bar=False).run(jax.random.PRNGKey(0), 10, jnp.arange(9.0))
>>> nf.message_ledger(result)["messages_to_client"].shape  # one count per client
(3,)
"""

from __future__ import annotations

__all__ = ["message_ledger"]


def message_ledger(run) -> dict:
    """What crossed between the server and the clients (or between agents) in ``run``: an
    ``MCMC`` object run with one of the project's samplers, or a
    :class:`~numpyro_fed.infer.RunResult` of a variational method. The same shape for every
    algorithm (see the module's docstring).

    :raises TypeError: ``run`` is neither; ``ValueError``: a result that carries no ledger.
    """
    from numpyro.infer import MCMC

    from numpyro_fed.infer.base import RunResult
    from numpyro_fed.infer.kernel import FederatedMCMCKernel

    if isinstance(run, MCMC):
        if not isinstance(run.sampler, FederatedMCMCKernel):
            raise TypeError(
                f"message_ledger: the MCMC run's kernel is a {type(run.sampler).__name__}, not one of "
                "numpyro_fed's samplers (it sends no messages)"
            )
        return run.sampler.message_ledger(run)
    if isinstance(run, RunResult):
        if run.ledger is None:
            raise ValueError(f"message_ledger: this result of {type(run.method).__name__} carries no ledger")
        return dict(run.ledger)
    raise TypeError(f"message_ledger takes an MCMC run or a RunResult, not a {type(run).__name__}")
