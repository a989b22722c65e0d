"""The SVGD family's results as plain arrays for :func:`numpyro_fed.arviz.from_dicts`."""

from __future__ import annotations

import numpy as np

from numpyro_fed.arviz import federation_attrs, from_dicts, register_converter
from numpyro_fed.infer.stein.face import ParticleRunResult

__all__ = ["inference_data_arrays"]


def inference_data_arrays(result: ParticleRunResult) -> dict:
    """``posterior``: the final particles (one chain, a draw per particle), constrained, by
    site; ``sample_stats``: the per-round metrics with a ``round`` dimension; ``coords``;
    ``attrs``: the algorithm, its settings and the federation. Plain arrays, the keyword
    arguments of :func:`numpyro_fed.arviz.from_dicts`."""
    method = result.method
    draws = {k: np.asarray(v)[None] for k, v in method.constrained(result.particles).items()}
    sample_stats = {}
    for name, value in result.metrics.items():
        value = np.asarray(value)
        sample_stats[name] = (value, ["round"] + [f"{name}_dim_{j}" for j in range(value.ndim - 1)])
    attrs = {"algorithm": type(method).__name__, "num_particles": int(result.particles.shape[0])}
    for name in ("kde_bandwidth", "num_local_steps", "num_distill_steps", "temperature"):
        if hasattr(method, name):
            attrs[name] = getattr(method, name)
    if method.federated_potential is not None:
        attrs.update(federation_attrs(method.federated_potential))
    coords = {"round": np.arange(1, len(result.history))}
    return {"posterior": draws, "sample_stats": sample_stats, "coords": coords, "attrs": attrs}


@register_converter(ParticleRunResult)
def _from_run_result(result: ParticleRunResult, **kwargs):
    arrays = inference_data_arrays(result)
    return from_dicts(arrays.pop("posterior"), **arrays, **kwargs)
