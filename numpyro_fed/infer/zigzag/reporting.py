"""What a FedZigZag run reports: its diagnostics, the exact moments and skeleton of its
path, per-client statistics and its message ledger, read from what ``MCMC`` recorded.

:class:`ZigZagReports` is the part of :class:`~numpyro_fed.infer.zigzag.FedZigZag` that reads
a finished run; the functions it calls live in :mod:`~numpyro_fed.infer.zigzag.diagnostics`.
"""

from __future__ import annotations

import numpy as np

import jax

from numpyro_fed.infer.kernel import RunCheck
from numpyro_fed.infer.zigzag.bounds import bound_kind
from numpyro_fed.infer.zigzag.diagnostics import (
    DIAGNOSTICS,
    SKELETON,
    TRAJECTORY,
    few_effective_draws,
    per_client_stats,
    rate_problems,
    round_ledger,
    run_ledger,
    skeleton_of,
    term_ledger,
    trajectory_moments_of,
)

__all__ = ["ZigZagReports"]


class ZigZagReports:
    """The reading of a finished run, mixed into
    :class:`~numpyro_fed.infer.zigzag.FedZigZag` (it reads the sampler's settings and what its
    set-up recorded: ``bounds``, ``subsample_size``, ``preconditioning``, ``thinning``,
    ``message_sizes``, ``ledger_baseline``...)."""

    @property
    def default_fields(self):
        fields = DIAGNOSTICS + TRAJECTORY + (SKELETON if self.skeleton_size else ())
        return ("z",) + tuple("info." + name for name in fields)

    def diagnose(self, mcmc, *, min_ess: float = 50.0) -> RunCheck:
        """What went wrong in a run, if anything (:meth:`check_run` warns, or raises with
        ``strict``; :func:`~numpyro_fed.to_inference_data` calls it): proposals whose exact
        rate exceeded its bound (each one biases the chain slightly), samples cut short by
        ``max_proposals``, and draws too few to summarize: a site's element with fewer than
        ``min_ess`` effective draws (NumPyro's estimator over the chains), whose mean then
        carries a Monte Carlo error above ``1 / sqrt(min_ess)`` (0.14) of its sd.

        Its ``result`` (what :meth:`check_run` returns) is ``(num_violations, num_proposals,
        num_capped_samples)``.
        """
        problems = few_effective_draws(
            mcmc.get_samples(group_by_chain=True), min_ess, preconditioned=self.preconditioning is not None
        )
        interval = self.sample_interval
        state = getattr(mcmc, "last_state", None)
        if interval is None and state is not None and hasattr(state, "adapt"):
            interval = float(f"{float(np.max(jax.device_get(state.adapt.interval))):.3g}")
        violations, proposals, capped, rates = rate_problems(
            mcmc.get_extra_fields(), kind=self._bound_kind(), max_proposals=self.max_proposals, sample_interval=interval
        )
        return RunCheck(problems + rates, (violations, proposals, capped))

    def _bound_kind(self):
        return "subsample" if self.subsample_size is not None else bound_kind(self.bounds)

    def trajectory_moments(self, mcmc):
        """Mean and covariance (or variance) of the whole sampled path, computed exactly
        from the piecewise-linear trajectory rather than from the draws; on the flat
        unconstrained space (see :meth:`FederatedPotential.unravel`).

        :return: ``{"mean": (d,), "cov": (d, d)}`` with ``full_covariance``, else
            ``{"mean": (d,), "var": (d,)}``.
        """
        return trajectory_moments_of(mcmc.get_extra_fields(), self.preconditioning)

    def skeleton(self, mcmc, *, chain: int = 0):
        """The recorded switches of one chain's sampling phase: ``(times, positions,
        velocities)`` with times counted from the first sample's start, positions flat
        unconstrained. The path is the straight line between consecutive points."""
        if not self.skeleton_size:
            raise ValueError("no skeleton was recorded: pass skeleton_size > 0 to FedZigZag")
        return skeleton_of(mcmc.get_extra_fields(group_by_chain=True), chain, self.skeleton_size, self.preconditioning)

    def sample_stats(self, extra_fields):
        """Diagnostics by name from ``MCMC.get_extra_fields(group_by_chain=True)``:
        ``{name: (array, dims)}``; per-client counts get a ``client`` dim, the prior's
        proposer (when it is the server's) its own entries. With a ``federation``, the message
        ledger of every draw: ``messages_to_client``, ``bytes_to_client``,
        ``messages_from_client``, ``bytes_from_client`` (``client`` dim; see
        :meth:`message_ledger`). ``grad_row_evals`` (and ``grad_row_evals_by_client``): the
        row gradients the clients evaluated in each draw, their gradient evaluations times
        :attr:`rows_per_gradient` (all their rows, or with ``subsample_size`` the batch at
        the point and at the reference)."""
        num_clients = self.federated_potential.num_clients
        stats = per_client_stats(extra_fields, num_clients, self.prior == "server")
        evals = extra_fields.get("info.grad_evals_by_proposer")
        if evals is not None and self.rows_per_gradient is not None:
            rows = np.asarray(jax.device_get(evals))[..., :num_clients].astype(np.int64) * self.rows_per_gradient
            stats["grad_row_evals_by_client"] = (rows, ["client"])
            stats["grad_row_evals"] = (rows.sum(-1), [])
        if self.thinning == "clients" and "info.rounds" in extra_fields:
            rounds = np.asarray(jax.device_get(extra_fields["info.rounds"]))
            stats.update(
                {
                    name: (value, ["client"])
                    for name, value in round_ledger(rounds, num_clients, self.message_sizes).items()
                }
            )
        return stats

    def message_ledger(self, mcmc) -> dict:
        """What crossed the wire in ``mcmc``'s run, per client: ``{name: (M,) int array}``
        with the names of :meth:`MessageLedger.summary
        <numpyro_fed.federation.MessageLedger.summary>`: totals (``messages_to_client``,
        ``bytes_to_client``, ``messages_from_client``, ``bytes_from_client``, ``rounds``) and
        the same per call, prefixed ``"propose/"``, ``"value_and_grad/"``, ``"hessian/"``.

        ``propose``: in a round the server sends every client the current point and its
        settings, and every client answers with one
        :class:`~numpyro_fed.infer.zigzag.federated.Proposal` (its first switching time and
        coordinate; plus its :class:`~numpyro_fed.infer.zigzag.federated.ClientCounts` when no
        privacy guarantee is asked for); the rounds of the warmup's draws are included when
        ``mcmc`` recorded them (``collect_warmup=True``): the core counts these calls itself
        (they happen at every event). Every other call since ``init`` began is as the
        federation counted it (:mod:`~numpyro_fed.infer.zigzag.setup`: the mode search, the
        control variates' reference, a Laplace preconditioner; the warmup's re-centering and
        comparison): ``d`` numbers down per message, ``d + 1`` up for ``"value_and_grad"``,
        ``d^2`` for ``"hessian"``.

        With the server's thinning (``thinning="server"``) there are no rounds: the calls are
        ``"grad_and_slope"`` (every line's bound asks every client, once per evaluation) and
        ``"grad"`` (each proposal's winner alone), counted from the draws' gradient
        evaluations (:func:`~numpyro_fed.infer.zigzag.diagnostics.term_ledger`)."""
        num_clients = self.federated_potential.num_clients
        fields = mcmc.get_extra_fields()
        if self.thinning == "server":
            d, itemsize = self.message_dims
            rounds = term_ledger(
                jax.device_get(fields["info.grad_evals_by_proposer"]),
                jax.device_get(fields["info.num_proposals"]),
                num_clients,
                d,
                itemsize,
            )
            kernel_calls = ("grad_and_slope", "grad")
        else:
            rounds = np.asarray(jax.device_get(fields["info.rounds"]))
            kernel_calls = ("propose",)
        counted = {}
        if self.ledger_baseline is not None:
            for key, delta in self.federation.ledger.since(self.ledger_baseline).items():
                name = key.split("/", 1)
                # calls by name only: the totals are summed again below; an engine also counted
                # the core's own calls, which its draws' infos give per run
                if len(name) == 2 and not (name[0] in kernel_calls and not self.federation.in_process):
                    if delta.any():
                        counted[key] = delta
        return run_ledger(rounds, num_clients, self.message_sizes, counted)

    def get_diagnostics_str(self, state):
        return "{} events, {} proposals".format(int(state.info.num_events), int(state.info.num_proposals))
