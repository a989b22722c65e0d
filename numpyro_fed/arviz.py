"""Conversion of every result of the project to ArviZ's data structure.

This is the only module that builds ArviZ objects or calls ArviZ's statistics, and it imports
ArviZ only when a result is converted or a check reads ArviZ's Pareto-smoothed importance
sampling (:func:`psis_log_weights`; ``import numpyro_fed`` does not import ArviZ, as ``import
numpyro`` does not).
It returns what ArviZ's own :func:`arviz.from_numpyro` returns for the installed ArviZ: an
:class:`xarray.DataTree` on ArviZ 1.x (Python >= 3.12), an :class:`arviz.InferenceData` on
ArviZ 0.2x (Python 3.10 and 3.11, where ArviZ 1.x cannot be installed). Both have the groups
as attributes (``idata.posterior``), ``"posterior" in idata`` and ``idata.attrs``.

Algorithms register a converter for their result type with :func:`register_converter`; the
converter hands plain arrays to :func:`from_dicts`, and :func:`to_inference_data` dispatches
on the object's type.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["register_converter", "to_inference_data", "federation_attrs", "from_dicts"]

_CONVERTERS: list[tuple[type, Callable[..., Any], bool]] = []

# what to_inference_data adds to any result whose converter does not take them itself
_DATA_OPTIONS = ("log_likelihood", "observed_data", "model_args", "model_kwargs")


def register_converter(result_type: type, *, handles_data: bool = False):
    """Decorator: registers ``fn(obj, **options)`` for ``result_type``, the converter that
    :func:`to_inference_data` calls for such an object. It should build its result with
    :func:`from_dicts`. Unless ``handles_data``, the options ``log_likelihood``,
    ``observed_data``, ``model_args`` and ``model_kwargs`` do not reach it:
    :func:`to_inference_data` adds those groups itself from the model of ``obj.method``."""

    def decorator(fn):
        _CONVERTERS.insert(0, (result_type, fn, handles_data))
        return fn

    return decorator


def to_inference_data(obj: Any, *args, **kwargs):
    """Converts a result of any algorithm of the project to ArviZ's data structure (what
    :func:`arviz.from_numpyro` returns: an :class:`xarray.DataTree` on ArviZ 1.x):

    * ``posterior``: constrained sites, dims named after their plates;
    * ``sample_stats``: the algorithm's diagnostics (per-client ones with a ``client`` dim);
    * ``attrs``: ``algorithm``, ``num_clients``, ``client_sizes`` and, where the algorithm
      has one, its privacy guarantee.

    Observed data and pointwise log-likelihoods stay out unless asked for
    (``observed_data=True``, ``log_likelihood=True``; the latter for :func:`arviz.loo`):
    collecting them pools the clients' data, which the federated setting forbids. A result
    that does not keep the data it was fitted to (a variational method's ``RunResult``)
    needs them as ``model_args=`` (and ``model_kwargs=``), as
    :func:`arviz.from_numpyro_svi` does.

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
    >>> idata.attrs["num_clients"], "posterior" in idata, "observed_data" in idata
    (2, True, False)
    >>> idata.posterior["mu"].dims
    ('chain', 'draw')
    """
    for result_type, converter, handles_data in _CONVERTERS:
        if isinstance(obj, result_type):
            break
    else:
        known = ", ".join(t.__name__ for t, _, _ in _CONVERTERS)
        raise TypeError(f"to_inference_data: no converter for {type(obj).__name__} (known: {known})")
    with warnings.catch_warnings():
        # The converters name the chain and draw axes themselves, so ArviZ's guess that more
        # chains than draws means mislabelled axes is wrong here: DADMMS runs many short
        # chains by design (e.g. 100 of 50 draws). ArviZ 1.x's words, then 0.2x's.
        warnings.filterwarnings("ignore", message="Found chain dimension to be longer than draw dimension")
        warnings.filterwarnings("ignore", message=r"More chains \(\d+\) than draws \(\d+\)")
        if handles_data:
            return converter(obj, *args, **kwargs)
        data = {name: kwargs.pop(name) for name in _DATA_OPTIONS if name in kwargs}
        idata = converter(obj, *args, **kwargs)
        if data.get("log_likelihood") or data.get("observed_data"):
            idata = _add_client_data(idata, _model_of(obj), **data)
    return idata


def federation_attrs(potential) -> dict[str, Any]:
    """The attributes that describe a federation (from a :class:`FederatedPotential`)."""
    return {
        "num_clients": int(potential.num_clients),
        "client_sizes": [int(n) for n in potential.client_sizes],
        "federated_plates": list(potential.plates),
    }


@functools.cache
def _arviz_major() -> int:
    """The installed ArviZ's major version (imports ArviZ): 1 builds an
    :class:`xarray.DataTree`, 0 an :class:`arviz.InferenceData`."""
    import arviz

    return int(arviz.__version__.split(".")[0])


def psis_log_weights(log_ratios):
    """``(smoothed log weights, Pareto k-hat)`` of the importance ratios ``exp(log_ratios)``
    ``(S,)`` by ArviZ's Pareto-smoothed importance sampling (imports ArviZ). ArviZ 1.x's
    ``arviz_stats`` takes a log-likelihood and smooths ``exp(-ary)`` (LOO's ratios), ArviZ
    0.2x's ``arviz.psislw`` the log weights themselves."""
    log_ratios = np.asarray(log_ratios, np.float64)
    if _arviz_major() >= 1:
        from arviz_stats.base import array_stats

        log_weights, pareto_k = array_stats.psislw(-log_ratios)
    else:
        from arviz import psislw

        log_weights, pareto_k = psislw(log_ratios)
    return np.asarray(log_weights), float(np.asarray(pareto_k))


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

    :param posterior: constrained draws by site, each ``(chain, draw, *site_shape)``.
    :param dims: the names of a site's dims after ``chain`` and ``draw`` (e.g. its plates).
    :param sample_stats: name -> ``(values, dims)`` with every dim named (e.g.
        ``["round", "client"]``).
    :param coords: coordinates by dim name.
    :param attrs: set on the result and on every group.

    >>> import numpy as np
    >>> from numpyro_fed.arviz import from_dicts
    >>> idata = from_dicts({"w": np.zeros((1, 10, 3))}, dims={"w": ["feature"]},
    ...                    sample_stats={"loss": (np.ones(5), ["round"])}, attrs={"algorithm": "X"})
    >>> idata.posterior["w"].dims, idata.sample_stats["loss"].dims, idata.attrs["algorithm"]
    (('chain', 'draw', 'feature'), ('round',), 'X')
    """
    posterior = {k: np.asarray(v) for k, v in posterior.items()}
    dims = {name: list(d) for name, d in (dims or {}).items() if name in posterior}
    groups = {"posterior": _dataset(posterior, dims=dims, coords=coords, sample_dims=("chain", "draw"))}
    if sample_stats:
        groups["sample_stats"] = _dataset(
            {name: value for name, (value, _) in sample_stats.items()},
            dims={name: list(d) for name, (_, d) in sample_stats.items()},
            coords=coords,
            sample_dims=(),
        )
    return _build(groups, attrs or {})


def _model_of(obj):
    """The model a result was fitted with: ``obj.method.model`` (a ``RunResult``) or
    ``obj.model``."""
    model = getattr(getattr(obj, "method", None), "model", None) or getattr(obj, "model", None)
    if model is None:
        raise TypeError(
            f"to_inference_data: a {type(obj).__name__} does not say which model it "
            "fitted, so log_likelihood and observed_data cannot be computed"
        )
    return model


def _add_client_data(idata, model, *, log_likelihood=False, observed_data=False, model_args=(), model_kwargs=None):
    """``idata`` with the groups ``log_likelihood`` (every observed site's pointwise
    log-likelihood at every posterior draw) and ``observed_data``, as asked for."""
    model_args, model_kwargs = tuple(model_args or ()), dict(model_kwargs or {})
    if not (model_args or model_kwargs):
        raise TypeError(
            "log_likelihood=True and observed_data=True need the data the result was "
            "fitted to: pass model_args=(...) (and model_kwargs=) to to_inference_data"
        )
    from numpyro_fed.potential.trace import site_dims

    groups = _groups_of(idata)
    trace = _trace(model, model_args, model_kwargs)
    observed = {name: site for name, site in trace.items() if site["type"] == "sample" and site["is_observed"]}
    if log_likelihood:
        from numpyro.infer import log_likelihood as numpyro_log_likelihood

        posterior = {k: np.asarray(v) for k, v in groups["posterior"].data_vars.items()}
        chains, draws = next(iter(posterior.values())).shape[:2]
        flat = {k: v.reshape((chains * draws,) + v.shape[2:]) for k, v in posterior.items()}
        values = numpyro_log_likelihood(model, flat, *model_args, **model_kwargs)
        values = {k: np.asarray(v).reshape((chains, draws) + v.shape[1:]) for k, v in values.items()}
        # pointwise: a site's batch (plate) dims, not its event dims
        dims = {k: [f.name for f in sorted(observed[k]["cond_indep_stack"], key=lambda f: f.dim)] for k in values}
        groups["log_likelihood"] = _dataset(values, dims=dims, coords=None, sample_dims=("chain", "draw"))
    if observed_data:
        groups["observed_data"] = _dataset(
            {k: site["value"] for k, site in observed.items()},
            dims={k: site_dims(site) for k, site in observed.items()},
            coords=None,
            sample_dims=(),
        )
    return _build(groups, dict(idata.attrs))


# -- building blocks (the only code that knows which ArviZ is installed) ---------------------


def _dataset(values: dict[str, Any], *, dims, coords, sample_dims):
    """An :class:`xarray.Dataset` of ``values``: leading ``sample_dims``, then ``dims``."""
    import arviz as az

    values = {k: np.asarray(v) for k, v in values.items()}
    if _arviz_major() >= 1:
        return az.dict_to_dataset(values, coords=coords, dims=dims, sample_dims=list(sample_dims), index_origin=0)
    return az.dict_to_dataset(
        values, library=None, coords=coords, dims=dims, default_dims=list(sample_dims), index_origin=0
    )


def _groups_of(idata) -> dict:
    """The groups of what ArviZ built, as :class:`xarray.Dataset` by name."""
    if _arviz_major() >= 1:
        return {name: node.to_dataset() for name, node in idata.children.items()}
    return {name: idata[name] for name in idata.groups()}


def _build(groups: dict, attrs: dict[str, Any]):
    """ArviZ's object from datasets by group; ``attrs`` on it and on every group."""
    attrs = {k: _jsonable(v) for k, v in attrs.items()}
    groups = {name: dataset.assign_attrs(attrs) for name, dataset in groups.items()}
    if _arviz_major() >= 1:
        import xarray as xr

        idata = xr.DataTree.from_dict(groups)
    else:
        import arviz as az

        idata = az.InferenceData(**groups)
    idata.attrs.update(attrs)
    return idata


def _jsonable(value):
    if isinstance(value, (np.ndarray, tuple)):
        return np.asarray(value).tolist()
    return value


def _trace(model, args, kwargs):
    from numpyro import handlers
    from numpyro.infer.initialization import init_to_sample

    seeded = handlers.substitute(handlers.seed(model, 0), substitute_fn=init_to_sample)
    return handlers.trace(seeded).get_trace(*args, **kwargs)


def _plate_dims(model, args, kwargs) -> dict[str, list[str]]:
    """Dims of every site named after its plates (and event dims), from one concrete trace of
    the model. ArviZ's own inference (``jax.eval_shape`` of a trace) fails on a second call
    with other data arrays: a federated plate carries its client assignment, an array, in
    metadata that JAX compares between calls."""
    from numpyro_fed.potential.trace import model_site_dims

    return model_site_dims(_trace(model, args, kwargs))


# -- NumPyro's MCMC (NUTS, and this project's MCMC kernels) ----------------------------------


def _register_numpyro_mcmc():
    from numpyro.infer import MCMC

    @register_converter(MCMC, handles_data=True)
    def _from_mcmc(
        mcmc, *, potential=None, observed_data=False, log_likelihood=False, model_args=None, model_kwargs=None, **kwargs
    ):
        # model_args, model_kwargs: accepted as for every result, and not needed: an MCMC run
        # keeps the arguments it ran with
        import arviz as az

        sampler = mcmc.sampler
        if hasattr(sampler, "check_run"):
            sampler.check_run(mcmc)
        split = getattr(sampler, "federated_potential", None)
        if split is not None and split.deployed and not (mcmc._args or mcmc._kwargs):
            # deployment: the rows are on the clients; the model is traced with stand-ins (zeros
            # shaped like the pooled arguments), so observations and likelihoods cannot be had
            if observed_data or log_likelihood:
                raise ValueError(
                    "the clients loaded their own rows (deployment): the driver has no "
                    "observed data and no per-row log-likelihood; convert with "
                    "observed_data=False and log_likelihood=False"
                )
            mcmc = copy.copy(mcmc)
            mcmc._args, mcmc._kwargs = split.stand_in_arguments
        if kwargs.get("dims") is None:
            # NumPyro keeps the model's arguments of the last run only in MCMC._args and
            # MCMC._kwargs (no public accessor; ArviZ's from_numpyro reads the same fields).
            kwargs["dims"] = _plate_dims(sampler.model, mcmc._args, mcmc._kwargs)
        kwargs.setdefault("pred_dims", kwargs["dims"])  # ArviZ 1.x infers these too otherwise
        groups = _groups_of(az.from_numpyro(mcmc, log_likelihood=log_likelihood, **kwargs))
        # from_numpyro always adds the observed (and constant) data; they leave the clients
        # only when asked for
        keep = {"observed_data": observed_data, "constant_data": observed_data, "log_likelihood": log_likelihood}
        groups = {name: dataset for name, dataset in groups.items() if keep.get(name, True)}
        if hasattr(sampler, "extra_groups"):
            # draws beside the posterior ones (e.g. every agent's, their average), dims as in
            # the posterior (named after plates) after the group's own leading dims
            posterior = groups["posterior"]
            for group, (values, leading) in sampler.extra_groups(mcmc).items():
                dims = {
                    name: ["chain", "draw", *leading, *posterior[name].dims[2:]] for name in values if name in posterior
                }
                groups[group] = _dataset(values, dims=dims, coords=kwargs.get("coords"), sample_dims=())
        if hasattr(sampler, "sample_stats"):
            stats = sampler.sample_stats(mcmc.get_extra_fields(group_by_chain=True))
            groups["sample_stats"] = _dataset(
                {name: value for name, (value, _) in stats.items()},
                dims={name: list(dims) for name, (_, dims) in stats.items()},
                coords=kwargs.get("coords"),
                sample_dims=("chain", "draw"),
            )
        attrs = {"algorithm": type(sampler).__name__}
        if potential is None:
            potential = getattr(sampler, "federated_potential", None)
        if potential is not None:
            attrs.update(federation_attrs(potential))
        privacy = getattr(sampler, "privacy", None)
        if privacy is not None:
            attrs.update(privacy.as_attrs())
        return _build(groups, attrs)


_register_numpyro_mcmc()
