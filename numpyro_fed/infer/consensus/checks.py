"""When consensus Monte Carlo's combination can be trusted: the statistics the server computes
from what the clients sent, and the warnings they raise.

Both combinations are exact for Gaussian sub-posteriors and biased otherwise (Scott et al.
2016, Section 3; Neiswanger et al. 2014): the clients' draws must look Gaussian, and their
sub-posteriors must agree, each client's mean within its own spread of the combined one (where
they do not, the product lives in the tails of the sub-posteriors, where a Gaussian
approximation is worst).
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy import stats

__all__ = ["ConsensusWarning", "agreement", "gaussianity", "warn_untrustworthy"]

#: a Gaussian's draws have |skewness| and |excess kurtosis| near 0: allowed beyond their
#: Monte Carlo error (3 standard errors at the client's effective sample size)
SKEWNESS_TOLERANCE = 0.3
KURTOSIS_TOLERANCE = 1.0
#: the family-wise level of the agreement test over the clients (Bonferroni)
AGREEMENT_LEVEL = 1e-3
RHAT_TOLERANCE = 1.05
MIN_ESS = 50.0


class ConsensusWarning(RuntimeWarning):
    """A consensus Monte Carlo run whose combination is not trustworthy (the message gives the
    statistic and what to change)."""


def gaussianity(skewness, kurtosis, ess):
    """``(excess, worst)``: per client and coordinate, how far ``skewness`` and ``kurtosis``
    (excess; ``(M, d)``) exceed what a Gaussian's draws show at effective sample size ``ess``
    (``(M, d)``): ``max(|skew| - allowance_skew, |kurt| - allowance_kurt)``, positive where a
    sub-posterior is not Gaussian; ``worst``, the ``(client, coordinate)`` of its maximum."""
    n = np.maximum(np.asarray(ess, float), 4.0)
    allow_skew = SKEWNESS_TOLERANCE + 3.0 * np.sqrt(6.0 / n)
    allow_kurt = KURTOSIS_TOLERANCE + 3.0 * np.sqrt(24.0 / n)
    excess = np.maximum(np.abs(skewness) - allow_skew, np.abs(kurtosis) - allow_kurt)
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    return excess, tuple(int(i) for i in worst)


def agreement(means, covs, combined_mean):
    """``(distance_sq, p_value)`` per client: the squared Mahalanobis distance of client ``m``'s
    mean from the combined mean in client ``m``'s own covariance, and its chi-squared tail
    probability with ``d`` degrees of freedom (about chi-squared when the clients' data are
    exchangeable and the sub-posteriors Gaussian: each client's estimate varies about the
    whole data's by about its own spread)."""
    means, covs = np.asarray(means, float), np.asarray(covs, float)
    diff = means - np.asarray(combined_mean, float)[None]
    distance_sq = np.array([diff[m] @ np.linalg.solve(covs[m], diff[m]) for m in range(means.shape[0])])
    return distance_sq, stats.chi2.sf(distance_sq, df=means.shape[1])


def warn_untrustworthy(metrics: dict, coordinate_names, *, stacklevel: int = 3) -> None:
    """Warns (:class:`ConsensusWarning`) where the run's per-client statistics (``metrics``,
    each with a leading client axis: ``skewness``, ``kurtosis``, ``ess``, ``rhat``,
    ``local_rhat``, ``divergences``, ``p_agreement``, ``distance_sq``, ``hessian_weight``) say
    the combination is not to be trusted, naming the client, the coordinate and the
    statistic."""
    names = list(coordinate_names)
    num_clients = metrics["skewness"].shape[0]
    excess, (m, j) = gaussianity(metrics["skewness"], metrics["kurtosis"], metrics["ess"])
    if excess[m, j] > 0:
        bad = int((excess > 0).any(axis=1).sum())
        warnings.warn(
            f"ConsensusMC: {bad} of {num_clients} sub-posteriors are far from Gaussian, so the Gaussian "
            f"combination is biased; worst: client {m}, {names[j]}: skewness {metrics['skewness'][m, j]:.2f}, "
            f"excess kurtosis {metrics['kurtosis'][m, j]:.2f} (a Gaussian's: 0 +- "
            f"{3 * np.sqrt(6 / max(metrics['ess'][m, j], 4)):.2f} and 0 +- "
            f"{3 * np.sqrt(24 / max(metrics['ess'][m, j], 4)):.2f} at its ESS). Give each client more rows "
            "(fewer clients), reparameterize the skewed site, or use a sampler that is exact "
            "(nf.FedZigZag)",
            ConsensusWarning,
            stacklevel=stacklevel,
        )
    p = metrics["p_agreement"]
    if (p < AGREEMENT_LEVEL / num_clients).any():
        m = int(np.argmin(p))
        warnings.warn(
            f"ConsensusMC: the sub-posteriors disagree beyond their spread: client {m}'s mean is at squared "
            f"Mahalanobis distance {metrics['distance_sq'][m]:.1f} from the combined mean in its own covariance "
            f"(chi-squared with {len(names)} degrees of freedom: p = {p[m]:.2g}); the combination then rests "
            "on the sub-posteriors' tails. Check for clients whose data differ (heterogeneity), or use an "
            "exact federated sampler (nf.FedZigZag)",
            ConsensusWarning,
            stacklevel=stacklevel,
        )
    fallback = np.flatnonzero(np.asarray(metrics.get("hessian_weight", np.ones(num_clients))) < 0.5)
    if fallback.size:
        ess = np.asarray(metrics["ess"])[fallback].min()
        warnings.warn(
            f"ConsensusMC: the expected Hessian of client(s) {fallback.tolist()} does not describe their draws "
            "(not positive definite, or the whitened eigenvalues of their sample covariance times it outside "
            f"1/3 to 3): their weights are their sample covariances (smallest ESS {ess:.0f}), whose Monte Carlo error "
            "moves the combined mean (0.1-0.3 posterior sds per coordinate at 400 effective draws, 7 coordinates and "
            "8 clients); the sub-posteriors are likely far from Gaussian. Increase num_samples, or use an exact "
            "federated sampler (nf.FedZigZag)",
            ConsensusWarning,
            stacklevel=stacklevel,
        )
    rhat = np.maximum(np.nan_to_num(metrics["rhat"], nan=np.inf).max(axis=1), metrics["local_rhat"])
    ess = metrics["ess"].min(axis=1)
    divergences = metrics["divergences"]
    if (rhat > RHAT_TOLERANCE).any() or (ess < MIN_ESS).any() or (divergences > 0).any():
        m = int(np.argmax(rhat))
        warnings.warn(
            f"ConsensusMC: sub-posterior chains did not mix: largest split R-hat {rhat[m]:.3f} (client {m}), "
            f"smallest ESS {ess.min():.0f} (client {int(np.argmin(ess))}), divergences per client "
            f"{divergences.tolist()}; increase num_warmup and num_samples (or num_chains), or raise "
            "target_accept_prob in kernel_kwargs",
            ConsensusWarning,
            stacklevel=stacklevel,
        )
