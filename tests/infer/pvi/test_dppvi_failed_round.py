"""A DPPVI run whose local fits fail says so, instead of handing back ``q`` as an answer."""

import warnings

import numpy as np
import pytest

from numpyro_fed.infer.pvi.diagnostics import judge_run


def _metrics(residual, loss, rejected, dim=3, rounds=3):
    return {
        "residual": np.asarray(residual, float).reshape(1, -1).repeat(rounds, 0),
        "loss": np.full(rounds, loss),
        "rejected": np.asarray(rejected).reshape(1, -1).repeat(rounds, 0),
        "loc": np.zeros((rounds, dim)),
        "scale": np.ones((rounds, dim)),
        "last_move": np.zeros((rounds, dim)),
        "clipped": np.zeros((rounds, 2)),
        "predicted_dp_error": np.zeros(rounds),
    }


@pytest.mark.parametrize(
    "residual, loss, rejected, named",
    [
        ([0.01, np.nan], 10.0, [0, 0], r"client\(s\) \[1\] ended non-finite"),
        ([0.01, 0.02], np.inf, [0, 0], r"the loss of q is inf"),
        ([0.01, 0.02], 10.0, [3, 3], r"every coordinate of every update was refused"),
    ],
    ids=["residual", "loss", "rejected"],
)
@pytest.mark.parametrize("dp", [None, "dpsgd"])
def test_a_failed_last_round_warns_for_every_variant(residual, loss, rejected, named, dp):
    with pytest.warns(RuntimeWarning, match=r"DPPVI: the last round failed: .*" + named):
        judge_run(dp, _metrics(residual, loss, rejected), private=dp is not None, clip_norm=1.0)
    with warnings.catch_warnings():  # a healthy round: no warning
        warnings.simplefilter("error")
        judge_run(dp, _metrics([0.01, 0.02], 10.0, [0, 0]), private=dp is not None, clip_norm=1.0)
