"""Conversion of every result of the project to :class:`arviz.InferenceData`.

This is the only module that imports ArviZ, so a move to ArviZ 1.x (``xarray.DataTree``)
touches this file alone. Algorithms register a converter for their result type with
:func:`register_converter`; :func:`to_inference_data` dispatches on the object's type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import arviz as az

__all__ = ["register_converter", "to_inference_data", "federation_attrs", "from_dicts"]

_CONVERTERS: list[tuple[type, Callable[..., az.InferenceData]]] = []

# Groups that carry client data; they leave the clients only when asked for.
_CLIENT_DATA_GROUPS = ("observed_data", "log_likelihood", "constant_data")


def register_converter(result_type: type):
    """Decorator: registers ``fn(obj, **kwargs) -> InferenceData`` for ``result_type``."""

    def decorator(fn):
        _CONVERTERS.insert(0, (result_type, fn))
        return fn

    return decorator


def to_inference_data(obj: Any, *args, **kwargs) -> az.InferenceData:
    """Converts a result of any algorithm of the project to :class:`arviz.InferenceData`.

    * ``posterior``: constrained sites, dims named after their plates;
    * ``sample_stats``: the algorithm's diagnostics (per-client ones with a ``client`` dim);
    * ``attrs``: ``algorithm``, ``num_clients``, ``client_sizes`` and, where the algorithm
      has one, its privacy guarantee.

    Observed data and pointwise log-likelihoods stay out unless asked for
    (``observed_data=True``, ``log_likelihood=True``): collecting them pools the clients'
    data, which the federated setting forbids.

    For a :class:`numpyro.infer.MCMC` run (e.g. the NUTS reference on pooled data) pass
    ``potential=`` (a :class:`~numpyro_fed.FederatedPotential`) to record the federation.

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC, NUTS
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> y = jax.numpy.arange(4.0)
    >>> mcmc = MCMC(NUTS(model), num_warmup=50, num_samples=50, progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(0), y)
    >>> idata = nf.to_inference_data(mcmc, potential=nf.split_potential(model, (y,)))
    >>> idata.attrs["num_clients"], "observed_data" in idata.groups()
    (2, False)
    """
    for result_type, converter in _CONVERTERS:
        if isinstance(obj, result_type):
            return converter(obj, *args, **kwargs)
    known = ", ".join(t.__name__ for t, _ in _CONVERTERS)
    raise TypeError(f"to_inference_data: no converter for {type(obj).__name__} (known: {known})")


def federation_attrs(potential) -> dict[str, Any]:
    """The attributes that describe a federation (from a :class:`FederatedPotential`)."""
    return {
        "num_clients": int(potential.num_clients),
        "client_sizes": [int(n) for n in potential.client_sizes],
        "federated_plates": list(potential.plates),
    }


def from_dicts(
    posterior: dict[str, Any],
    *,
    dims: dict[str, list[str]] | None = None,
    sample_stats: dict[str, tuple[Any, list[str]]] | None = None,
    coords: dict[str, Any] | None = None,
    attrs: dict[str, Any] | None = None,
):
    """Builds the ArviZ object of a result from plain arrays (the one builder every algorithm's
    converter calls, so that no other module builds ArviZ objects).

    ``posterior``: constrained draws by site, each ``(chain, draw, *site_shape)``; ``dims``:
    the names of a site's dims after ``chain`` and ``draw`` (e.g. its plates); ``sample_stats``:
    name -> ``(values, dims)`` with every dim named (e.g. ``["round", "client"]``);
    ``coords``: coordinates by dim name; ``attrs``: set on the result and on every group.
    """
    idata = az.from_dict(posterior={k: np.asarray(v) for k, v in posterior.items()},
                         dims=dims, coords=coords)
    if sample_stats:
        dataset = az.dict_to_dataset(
            {name: np.asarray(value) for name, (value, _) in sample_stats.items()},
            library=None, coords=coords, default_dims=[],
            dims={name: list(d) for name, (_, d) in sample_stats.items()},
        )
        idata.add_groups(sample_stats=dataset)
    return _set_attrs(idata, attrs or {})


def _drop_client_data(idata: az.InferenceData, *, observed_data: bool, log_likelihood: bool):
    keep = {"observed_data": observed_data, "constant_data": observed_data,
            "log_likelihood": log_likelihood}
    for group in _CLIENT_DATA_GROUPS:
        if not keep[group] and group in idata.groups():
            delattr(idata, group)
            idata._groups = [g for g in idata._groups if g != group]
    return idata


def _jsonable(value):
    if isinstance(value, (np.ndarray, tuple)):
        return np.asarray(value).tolist()
    return value


def _set_attrs(idata: az.InferenceData, attrs: dict[str, Any]) -> az.InferenceData:
    attrs = {k: _jsonable(v) for k, v in attrs.items()}
    idata.attrs.update(attrs)
    for group in idata.groups():
        getattr(idata, group).attrs.update(attrs)
    return idata


def _plate_dims(model, args, kwargs) -> dict[str, list[str]]:
    """Dims of every site named after its plates (and event dims), from one concrete trace of
    the model. ArviZ's own inference (``jax.eval_shape`` of a trace) fails on a second call
    with other data arrays: a federated plate carries its client assignment, an array, in
    metadata that JAX compares between calls."""
    from numpyro import handlers
    from numpyro.infer.initialization import init_to_sample

    seeded = handlers.substitute(handlers.seed(model, 0), substitute_fn=init_to_sample)
    trace = handlers.trace(seeded).get_trace(*args, **kwargs)
    dims = {}
    for name, site in trace.items():
        if site["type"] not in ("sample", "deterministic"):
            continue
        batch = [frame.name for frame in sorted(site["cond_indep_stack"], key=lambda f: f.dim)]
        event = list(site.get("infer", {}).get("event_dims", []))
        if batch or event:
            dims[name] = batch + event
    return dims


def _register_numpyro_mcmc():
    from numpyro.infer import MCMC

    @register_converter(MCMC)
    def _from_mcmc(mcmc, *, potential=None, observed_data=False, log_likelihood=False, **kwargs):
        sampler = mcmc.sampler
        if hasattr(sampler, "check_run"):
            sampler.check_run(mcmc)
        if kwargs.get("dims") is None:
            kwargs["dims"] = _plate_dims(sampler.model, mcmc._args, mcmc._kwargs)
        idata = az.from_numpyro(mcmc, log_likelihood=log_likelihood, **kwargs)
        if hasattr(sampler, "extra_groups"):
            # draws beside the posterior ones (e.g. every agent's, their average), dims as in
            # the posterior (named after plates) after the group's own leading dims
            for group, (values, leading) in sampler.extra_groups(mcmc).items():
                dims = {name: list(leading) + list(idata.posterior[name].dims[2:])
                        for name in values if name in idata.posterior}
                dataset = az.dict_to_dataset(values, library=None, dims=dims)
                idata.add_groups({group: dataset})
        idata = _drop_client_data(idata, observed_data=observed_data, log_likelihood=log_likelihood)
        if hasattr(sampler, "sample_stats"):
            stats = sampler.sample_stats(mcmc.get_extra_fields(group_by_chain=True))
            sample_stats = az.dict_to_dataset(
                {name: value for name, (value, _) in stats.items()},
                library=None,
                dims={name: dims for name, (_, dims) in stats.items()},
            )
            if "sample_stats" in idata.groups():
                del idata.sample_stats
            idata.add_groups(sample_stats=sample_stats)
        attrs = {"algorithm": type(sampler).__name__}
        if potential is None:
            potential = getattr(sampler, "federated_potential", None)
        if potential is not None:
            attrs.update(federation_attrs(potential))
        privacy = getattr(sampler, "privacy", None)
        if privacy is not None:
            attrs.update(privacy.as_attrs())
        return _set_attrs(idata, attrs)


_register_numpyro_mcmc()
