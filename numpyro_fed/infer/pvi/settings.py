"""The settings of :class:`~numpyro_fed.DPPVI`: its default local optimizer and the checks of
its arguments (which combinations of privacy variant, schedule, sampling and noise make a run),
each a pure function of the arguments. The reasoning behind the automatic choices is in the
guide (``docs/guide/dppvi.md``, *Default settings*)."""

from __future__ import annotations

import optax

from numpyro_fed._checks import check_real
from numpyro_fed.infer.pvi.core import SCHEDULES
from numpyro_fed.privacy.accounting import check_sampling_rate

__all__ = [
    "DP_VARIANTS",
    "SAMPLING",
    "check_aggregation",
    "check_noise",
    "check_private_settings",
    "default_optimizer",
    "resolve_sampling",
]

DP_VARIANTS = (None, "dpsgd", "local_avg", "virtual")
SAMPLING = ("poisson", "without_replacement", "full")

#: Noise multipliers below this give epsilon in the hundreds (PLD accounting of 200 Poisson
#: steps at 0.1 gives about 2000 and takes 20 s; at 1e-3 the accountant asks for tens of GiB).
MIN_NOISE_MULTIPLIER = 0.3

# The default local optimizer's rate: from 0.1, cosine decay to 1% of it.
_DEFAULT_RATE = 0.1
_FINAL_RATE_SHARE = 0.01


def default_optimizer(num_local_steps: int):
    """The default local optimizer: Adam whose rate decays from 0.1 to 0.001 (cosine)
    over the ``num_local_steps`` steps of each local optimization. :class:`~numpyro_fed.DPPVI`
    runs it in standardized coordinates (steps in units of the current ``q``'s scale) and
    returns the average of the iterates over the second half of the steps."""
    return optax.adam(optax.cosine_decay_schedule(_DEFAULT_RATE, num_local_steps, alpha=_FINAL_RATE_SHARE))


def resolve_sampling(dp, sampling, sampling_rate):
    """``(sampling, sampling_rate, automatic)``: the minibatch sampling of the local
    optimization. DP-SGD given neither: Poisson at a rate chosen per run (``sampling_rate``
    ``None``, ``automatic`` true); otherwise Poisson when a rate is given, full batches when
    not.

    >>> resolve_sampling("dpsgd", None, None)
    ('poisson', None, True)
    >>> resolve_sampling(None, None, None)
    ('full', 1.0, False)
    """
    if dp not in DP_VARIANTS:
        raise ValueError(f"dp must be one of {DP_VARIANTS}, got {dp!r}")
    if sampling is not None and sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
    automatic = dp == "dpsgd" and sampling is None and sampling_rate is None
    if sampling is None:
        sampling = "poisson" if dp == "dpsgd" or sampling_rate is not None else "full"
    if automatic:
        rate = None  # resolved per run (sizes, rounds)
    elif sampling == "full":
        if sampling_rate not in (None, 1.0):
            raise ValueError("sampling='full' uses every row: leave sampling_rate unset")
        rate = 1.0
    else:
        if sampling_rate is None:
            raise ValueError(f"sampling={sampling!r} needs sampling_rate in (0, 1]")
        rate = check_sampling_rate(sampling_rate)
    if dp in ("local_avg", "virtual") and sampling != "full":
        raise ValueError(f"dp={dp!r} optimizes every shard on all its rows: use sampling='full'")
    return sampling, rate, automatic


def check_aggregation(dp, schedule, num_shards: int, trusted_aggregator: bool) -> None:
    """Shards and a trusted aggregator belong to update perturbation (``"local_avg"``,
    ``"virtual"``), the aggregator to the synchronous schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if num_shards > 1 and dp not in ("local_avg", "virtual"):
        raise ValueError("num_shards > 1 applies to dp='local_avg' or dp='virtual' only")
    if trusted_aggregator:
        if dp not in ("local_avg", "virtual"):
            raise ValueError(
                "trusted_aggregator=True applies to dp='local_avg' or dp='virtual' "
                "(DP-SGD's noise cannot be shared between clients)"
            )
        if schedule != "synchronous":
            raise ValueError("trusted_aggregator=True needs schedule='synchronous'")


def check_noise(dp, noise_multiplier, target_epsilon):
    """The noise multiplier, checked: a private variant needs it or a budget, a non-private
    run neither; zero (clipping without noise) takes no budget, and one too small to give any
    privacy is refused."""
    if dp is None:
        if noise_multiplier is not None or target_epsilon is not None:
            raise ValueError("dp=None is non-private: do not pass noise_multiplier or target_epsilon")
    elif noise_multiplier is None and target_epsilon is None:
        raise ValueError(f"dp={dp!r} needs noise_multiplier, target_epsilon or both")
    if noise_multiplier is None:
        return None
    noise_multiplier = check_real(noise_multiplier, "noise_multiplier")
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if noise_multiplier == 0 and target_epsilon is not None:
        raise ValueError("noise_multiplier=0 gives no privacy: do not pass target_epsilon")
    if 0 < noise_multiplier < MIN_NOISE_MULTIPLIER:
        raise ValueError(
            f"noise_multiplier={noise_multiplier} gives no meaningful privacy (epsilon in "
            f"the hundreds or more, which the accountant cannot compute in reasonable time "
            f"and memory): use noise_multiplier >= {MIN_NOISE_MULTIPLIER}, or dp=None"
        )
    return noise_multiplier


def check_private_settings(dp, private_randomness, budget):
    """``(private_randomness, budget)`` checked: ``private_randomness`` ``None`` (the
    default: client-private whenever the clients are separate parties), ``True`` or ``False``
    (reproducible deployed runs, and a guarantee that does not hold against the server);
    ``budget`` a :class:`~numpyro_fed.PrivacyBudget` for a private ``dp`` only."""
    from numpyro_fed.privacy.budget import PrivacyBudget

    if private_randomness is not None and not isinstance(private_randomness, bool):
        raise TypeError(f"private_randomness must be True, False or None, got {private_randomness!r}")
    if budget is not None:
        if not isinstance(budget, PrivacyBudget):
            raise TypeError(f"budget must be a numpyro_fed.PrivacyBudget, got {type(budget).__name__}")
        if dp is None:
            raise ValueError("budget= needs a private dp ('dpsgd', 'local_avg' or 'virtual'): dp=None spends nothing")
    return private_randomness, budget
