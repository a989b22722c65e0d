"""Reading a model's trace for :func:`~numpyro_fed.split_potential`: which sites are latent
and where, which plates are federated and who owns their rows, which model arguments carry
rows, the refusal of a forgotten observation, and the check that the split equals NumPyro's
potential energy."""

from __future__ import annotations

import inspect
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

import numpyro.distributions as dist
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.inspect import get_dependencies
from numpyro.primitives import Messenger

from numpyro_fed.plate import FEDERATED_KEY, normalize_clients

__all__ = ["PlateInfo"]


@dataclass(frozen=True)
class PlateInfo:
    """A federated plate as :func:`split_potential` found it.

    :ivar str name: plate name.
    :ivar int size: number of rows.
    :ivar int dim: plate dimension (negative, as in ``numpyro.plate``).
    :ivar numpy.ndarray owner: ``(size,)`` client id of each row.
    :ivar bool holds_data: ``True`` if observed sites live in the plate: its rows are cut
        per client (a *data* plate); ``False`` for plates that only hold latent variables
        (e.g. per-client random effects), whose rows stay in place and are masked.
    :ivar int max_rows: rows per client after padding (data plates).
    """

    name: str
    size: int
    dim: int
    owner: np.ndarray = field(repr=False)
    holds_data: bool
    max_rows: int

    @property
    def client_sizes(self) -> np.ndarray:
        return np.bincount(self.owner, minlength=int(self.owner.max()) + 1)


@dataclass(frozen=True)
class LatentSite:
    """A continuous latent site as :func:`analyse_trace` found it."""

    name: str
    plate: str | None  # None: a global site
    unconstrained_axis: int | None  # plate axis of the unconstrained value (negative)


# -- discovery ------------------------------------------------------------------------------


def discovery_trace(model, model_args, model_kwargs, rng_key, init_strategy, partition=None):
    """The model's trace at its initial values. A plain ``numpyro.plate`` named in
    ``partition`` whose size does not match the data fails inside NumPyro's broadcasting;
    that failure is re-raised as a ``ValueError`` naming the plate's size and the rows of the
    arguments that do not match it."""
    seeded = substitute(seed(model, rng_key), substitute_fn=init_strategy)
    sizes = _PlateSizes()
    try:
        with sizes:
            return trace(seeded).get_trace(*model_args, **model_kwargs)
    except (ValueError, TypeError) as exc:
        message = _plate_size_mismatch(sizes.sizes, partition or {}, model_args, model_kwargs)
        if message is None:
            raise
        raise ValueError(f"{message} (tracing the model raised {type(exc).__name__}: {exc})") from exc


#: NumPyro's argument validation of a distribution (``Normal distribution got invalid scale
#: parameter.``): at an initial point it means the point, not the model, is bad (an ``exp`` of
#: a coefficient times a raw covariate that overflowed), so another point is tried.
_INVALID_PARAMETER = re.compile(r"\w+ distribution got invalid \w+ parameter")


def is_invalid_parameter(exc: BaseException) -> bool:
    """Whether ``exc`` is NumPyro's validation error of a distribution's parameter (its own
    message, not one that quotes it, as the plate-size message of :func:`discovery_trace`)."""
    return isinstance(exc, ValueError) and bool(_INVALID_PARAMETER.match(str(exc)))


def init_traces(model, model_args, model_kwargs, rng_key, init_strategy, partition=None, *, first=0, errors=None):
    """``(attempt, trace)``: :func:`discovery_trace` at the initial points of attempts
    ``first`` to ``MAX_INIT_TRIES - 1`` (``rng_key``'s for attempt 0, ``fold_in(rng_key,
    attempt)``'s after it, as NumPyro's MCMC retries its init strategy), passing over a point
    where tracing raises NumPyro's invalid-parameter error (appended to ``errors``)."""
    for attempt in range(first, MAX_INIT_TRIES):
        key = jax.random.fold_in(rng_key, attempt) if attempt else rng_key
        try:
            model_trace = discovery_trace(model, model_args, model_kwargs, key, init_strategy, partition)
        except ValueError as exc:
            if not is_invalid_parameter(exc):
                raise
            if errors is not None:
                errors.append(exc)
            continue
        yield attempt, model_trace


def start_trace(model, model_args, model_kwargs, rng_key, init_strategy, partition=None):
    """``(trace, attempt)``: the first of :func:`init_traces`, the attempt
    :func:`finite_start` goes on from. Where every point raises NumPyro's invalid-parameter
    error, the error is re-raised naming how many points were tried and what to change."""
    errors = []
    for attempt, model_trace in init_traces(
        model, model_args, model_kwargs, rng_key, init_strategy, partition, errors=errors
    ):
        return model_trace, attempt
    raise ValueError(
        f"tracing the model raised NumPyro's '{errors[0]}' at every one of {MAX_INIT_TRIES} initial points the "
        "init_strategy drew. If the parameter depends on the latents (e.g. exp(coefficient x a raw "
        "covariate) overflows), start from a chosen point (init_strategy=init_to_value(values=...)) "
        "or rescale the covariate; if it depends only on the data, the data holds invalid values"
    ) from errors[0]


class _PlateSizes(Messenger):
    """Records the size of every plate the model enters, in order."""

    def __init__(self):
        super().__init__()
        self.sizes = {}

    def process_message(self, msg):
        if msg["type"] == "plate":
            self.sizes[msg["name"]] = int(msg["args"][0])


def _rows_given(clients):
    """How many rows a ``partition`` entry gives clients for (``None`` for a number of clients)."""
    if isinstance(clients, (int, np.integer)):
        return None
    if isinstance(clients, (list, tuple)) and clients and np.ndim(clients[0]) == 1:
        return int(sum(np.size(c) for c in clients))  # a list of index arrays, one per client
    return int(np.size(clients))


def _plate_size_mismatch(sizes, partition, model_args, model_kwargs):
    """What is wrong when a plate named in ``partition`` has a size none of the row arguments
    has, or ``None``."""
    leaves = jax.tree_util.tree_leaves((tuple(model_args), dict(model_kwargs)))
    rows = sorted({int(np.shape(x)[0]) for x in leaves if np.ndim(x) >= 1})
    for name in partition:
        if name not in sizes:
            continue
        size = sizes[name]
        owners = _rows_given(partition[name])
        if owners is not None and owners != size:
            return (
                f"plate '{name}' has size {size}, but partition['{name}'] gives clients for {owners} rows: "
                "give the plate the number of data rows, e.g. `numpyro.plate(name, X.shape[0])`, and one "
                "client per row"
            )
        if size not in rows:
            return (
                f"plate '{name}' (named in partition) has size {size}, but the model's array arguments "
                f"have {rows} rows: give the plate the number of data rows, e.g. "
                "`numpyro.plate(name, X.shape[0])`"
            )
    return None


def in_plates(site, plates) -> bool:
    """Whether a sample or deterministic site lies inside one of ``plates``."""
    return any(f.name in plates for f in site["cond_indep_stack"])


def site_dims(site) -> list[str]:
    """A sample or deterministic site's dims for ArviZ: its plates, outermost first, then the
    event dims it declares (``infer={"event_dims": [...]}``)."""
    batch = [frame.name for frame in sorted(site["cond_indep_stack"], key=lambda f: f.dim)]
    return batch + list(site.get("infer", {}).get("event_dims", []))


def model_site_dims(model_trace) -> dict[str, list[str]]:
    """``{site: dims}`` of every sample and deterministic site of ``model_trace`` that has any
    (:func:`site_dims`)."""
    return {
        name: site_dims(site)
        for name, site in model_trace.items()
        if site["type"] in ("sample", "deterministic") and site_dims(site)
    }


def _is_factor(site) -> bool:
    fn = site["fn"]
    while isinstance(fn, (dist.MaskedDistribution, dist.ExpandedDistribution, dist.Independent)):
        fn = fn.base_dist
    return isinstance(fn, dist.Unit)


def analyse_trace(model_trace, partition):
    """``(plates, latent_sites, enumerated)`` of a model's trace: a :class:`PlateInfo` of every
    federated plate (declared with ``federated_plate`` or named in ``partition``) that holds a
    sample site, every continuous latent site with the federated plate it lives in, and
    whether discrete latents are enumerated; a ``ValueError`` names what the split cannot
    take."""
    plate_args = {s["name"]: s["args"] for s in model_trace.values() if s["type"] == "plate"}
    for name in partition:
        if name not in plate_args:
            raise ValueError(
                f"partition names plate '{name}', but the model has no plate of that name "
                f"(plates: {sorted(plate_args)})"
            )
    sample_sites = [s for s in model_trace.values() if s["type"] == "sample"]
    specs, frames = _federated_frames(sample_sites, partition)
    plates = _plate_infos(specs, frames, plate_args, sample_sites)
    for site in sample_sites:
        if site["is_observed"] and not _is_factor(site):
            value = np.asarray(site["value"])
            if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                bad = np.argwhere(~np.isfinite(value))[0].tolist()
                raise ValueError(f"observed site '{site['name']}' holds non-finite data (first at index {bad})")
    latent_sites, enumerated = _latent_sites(sample_sites, plates)
    return plates, latent_sites, enumerated


def _federated_frames(sample_sites, partition):
    """``(specs, frames)``: every federated plate's client specs (one per ``federated_plate``
    entered, or the ``partition``'s) and its frame in the sites' plate stacks."""
    specs: dict[str, list] = {name: [clients] for name, clients in partition.items()}
    frames: dict[str, Any] = {}
    for site in sample_sites:
        for name, clients in (site.get("infer") or {}).get(FEDERATED_KEY, {}).items():
            if name in partition:
                raise ValueError(
                    f"plate '{name}' is already a federated_plate in the model; do not also name it in `partition`"
                )
            specs.setdefault(name, []).append(clients)
    if not specs:
        raise ValueError(
            "the model has no federated plate: wrap the data axis that is split across "
            "clients in `numpyro_fed.federated_plate(name, size, clients=...)`, or pass "
            "`partition={plate_name: clients}`"
        )
    for site in sample_sites:
        fed = [f for f in site["cond_indep_stack"] if f.name in specs]
        if len(fed) > 1:
            raise ValueError(
                f"site '{site['name']}' is inside nested federated plates "
                f"{[f.name for f in fed]}; a site can belong to one federated plate only"
            )
        for f in fed:
            frames.setdefault(f.name, f)
    return specs, frames


def _plate_infos(specs, frames, plate_args, sample_sites):
    """A :class:`PlateInfo` of every federated plate that encloses a sample site."""
    plates = {}
    for name, spec_list in specs.items():
        size, subsample_size = plate_args[name]
        if subsample_size is not None and subsample_size != size:
            raise ValueError(
                f"federated plate '{name}' is subsampled (subsample_size={subsample_size} of "
                f"{size}): the federated algorithms use every row; remove subsample_size"
            )
        owner, _ = normalize_clients(spec_list[0], size, name=name)
        for other in spec_list[1:]:
            other_owner, _ = normalize_clients(other, size, name=name)
            if not np.array_equal(owner, other_owner):
                raise ValueError(f"federated plate '{name}' is entered twice with different clients")
        if name not in frames:
            continue  # a federated plate with no sample site contributes nothing
        sites_inside = [s for s in sample_sites if frames[name] in s["cond_indep_stack"]]
        holds_data = any(s["is_observed"] and not _is_factor(s) for s in sites_inside)
        for s in sites_inside:
            if s["is_observed"] and not _is_factor(s):
                _check_observed_rows(s, frames[name], size)
        counts = np.bincount(owner)
        plates[name] = PlateInfo(
            name=name,
            size=size,
            dim=frames[name].dim,
            owner=owner,
            holds_data=holds_data,
            max_rows=int(counts.max()) if holds_data else size,
        )
    if not plates:
        raise ValueError(
            f"the federated plates {sorted(specs)} enclose no sample site: put the "
            "observed data (the likelihood) inside the federated plate"
        )
    return plates


def _latent_sites(sample_sites, plates):
    """``(latent_sites, enumerated)``: the continuous latent sites (a :class:`LatentSite`
    each) and whether discrete latents inside federated plates are enumerated."""
    latent_sites, enumerated = {}, False
    for site in sample_sites:
        if site["is_observed"]:
            continue
        fed = [f for f in site["cond_indep_stack"] if f.name in plates]
        if site["fn"].support.is_discrete:
            if not fed:
                raise ValueError(
                    f"site '{site['name']}' is a global discrete latent variable (outside every "
                    "federated plate): it cannot be split over clients; marginalise it in the "
                    "model or make it local to a federated plate"
                )
            if not site["fn"].has_enumerate_support:
                raise ValueError(
                    f"discrete latent site '{site['name']}' has no enumerable support, so it cannot be marginalised"
                )
            enumerated = True
            continue
        if isinstance(site["fn"], dist.Delta):
            raise ValueError(
                f"sample site '{site['name']}' has a Delta distribution; use numpyro.deterministic instead"
            )
        axis = plate_axis(site, fed[0].dim, constrained=False) if fed else None
        latent_sites[site["name"]] = LatentSite(site["name"], fed[0].name if fed else None, axis)
    return latent_sites, enumerated


def _check_observed_rows(site, frame, size):
    value_shape = jnp.shape(site["value"])
    axis = frame.dim - len(site["fn"].event_shape)
    if len(value_shape) >= -axis and value_shape[axis] not in (1, size):
        raise ValueError(
            f"observed site '{site['name']}' has {value_shape[axis]} rows along federated "
            f"plate '{frame.name}', but the plate has size {size}"
        )


def plate_axis(site, plate_dim, *, constrained):
    """Axis (negative) of the plate in the site's constrained or unconstrained value."""
    if constrained:
        return plate_dim - len(site["fn"].event_shape)
    return plate_dim - biject_to(site["fn"].support).domain.event_dim


def common_num_clients(plates):
    counts = {name: int(p.owner.max()) + 1 for name, p in plates.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"federated plates disagree on the number of clients: {counts}")
    return next(iter(counts.values()))


def find_row_leaves(leaves, plates) -> dict[int, str]:
    data_plates = {p.name: p.size for p in plates.values() if p.holds_data}
    row_leaves = {}
    for i, leaf in enumerate(leaves):
        shape = np.shape(leaf)
        if not shape or isinstance(leaf, (str, bytes)):
            continue
        matches = [name for name, size in data_plates.items() if shape[0] == size]
        if len(matches) > 1:
            raise ValueError(
                f"a model argument with leading axis {shape[0]} matches several federated "
                f"data plates {matches}; give the plates different sizes"
            )
        if matches:
            row_leaves[i] = matches[0]
    for name in data_plates:
        if name not in row_leaves.values():
            raise ValueError(
                f"federated plate '{name}' holds observed data, but no model argument has "
                f"{data_plates[name]} rows on its leading axis: pass the clients' data to the "
                "model as arguments (rows first) so that each client receives only its rows"
            )
    return row_leaves


def check_finite_arguments(model_args, model_kwargs):
    named = {"model_args": tuple(model_args), "model_kwargs": model_kwargs}
    for path, leaf in jax.tree_util.tree_flatten_with_path(named)[0]:
        if isinstance(leaf, (str, bytes)) or not np.ndim(leaf):
            continue
        array = np.asarray(leaf)
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            first = np.argwhere(~np.isfinite(array))[0].tolist()
            raise ValueError(
                f"model argument {jax.tree_util.keystr(path)} holds non-finite values (first at index {first})"
            )


def describe_leaves(treedef, num_leaves, row_leaves):
    labels = jax.tree_util.tree_unflatten(treedef, [f"#{i}" for i in range(num_leaves)])
    paths = jax.tree_util.tree_flatten_with_path(labels)[0]
    return {jax.tree_util.keystr(path): row_leaves[i] for i, (path, _) in enumerate(paths) if i in row_leaves}


def unconstrained_init(model_trace, latent_sites):
    z0 = {}
    for name in latent_sites:
        site = model_trace[name]
        z0[name] = biject_to(site["fn"].support).inv(site["value"])
    return z0


def owner_of_coordinates(site, plates, shape):
    if site.plate is None:
        return np.full(shape, -1, dtype=np.int64)
    owner = plates[site.plate].owner
    axis = site.unconstrained_axis
    return np.broadcast_to(owner.reshape((-1,) + (1,) * (-axis - 1)), shape).copy()


def scatter_rows(per_client, index, size, axis):
    """Puts clients' padded rows (leading client axis) back at their rows of the plate.

    Padding repeats one of the client's own rows, so duplicate indices write equal values.
    """
    rows_first = jnp.moveaxis(per_client, axis, 1)  # (M, max_rows, ...)
    flat = rows_first.reshape((-1,) + rows_first.shape[2:])
    out = jnp.zeros((size,) + rows_first.shape[2:], per_client.dtype)
    out = out.at[jnp.ravel(index)].set(flat)
    return jnp.moveaxis(out, 0, axis)


# -- a forgotten observation ---------------------------------------------------------------
#
# In NumPyro a sample site given ``obs=None`` is an ordinary latent site. Inside a federated
# plate it would become one latent value per row of the plate, sampled from its prior: the run
# would return the prior without a word (a discrete site would even be enumerated away). What
# tells such a site from a legitimate client-local latent (a per-row effect ``eta_i``, a mixture
# assignment ``z_i``, a per-group effect ``u_g``) is that nothing in the model depends on it, or
# that it bears the name of a model argument left ``None``.

# The site-level opt-in: ``numpyro.sample(name, fn, infer={"federated_latent": True})`` inside
# a federated plate is sampled even though nothing in the model depends on it.
LATENT_KEY = "federated_latent"


def check_observations(model, model_args, model_kwargs, model_trace, partition) -> None:
    """Raises a ``ValueError`` for the first latent site inside a federated plate that looks
    like a forgotten observation: it has the name of a model argument that is ``None`` (passed
    as ``None`` or left at a ``None`` default), or no other site of the model depends on it.
    Sites marked ``infer={"federated_latent": True}`` are left alone.

    :param model: the user's model.
    :param tuple model_args: its positional arguments.
    :param dict model_kwargs: its keyword arguments.
    :param model_trace: its discovery trace.
    :param dict partition: plates federated from outside the model (``split_potential``'s).
    """
    candidates = [site for site in model_trace.values() if _federated_latent_candidate(site, partition)]
    if not candidates:
        return
    unpassed = _arguments_left_none(model, model_args, model_kwargs)
    children = _children(model, model_args, model_kwargs)  # None: not traceable, the name rule only
    named = [site for site in candidates if site["name"] in unpassed]
    leaves = [site for site in candidates if children is not None and not children.get(site["name"])]
    for site in named + leaves:
        is_leaf = children is not None and not children.get(site["name"])
        raise ValueError(_message(site, partition, unpassed, is_leaf))


def _federated_plate_of(site, partition):
    """The federated plate frame enclosing ``site``, or ``None``."""
    names = set((site.get("infer") or {}).get(FEDERATED_KEY, {})) | set(partition)
    frames = [f for f in site["cond_indep_stack"] if f.name in names]
    return frames[0] if frames else None


def _federated_latent_candidate(site, partition) -> bool:
    if site["type"] != "sample" or site["is_observed"]:
        return False
    if (site.get("infer") or {}).get(LATENT_KEY, False):
        return False
    return _federated_plate_of(site, partition) is not None


def _bound_arguments(model, model_args, model_kwargs) -> dict | None:
    """``{parameter name: value}`` of this call of ``model``, defaults included; ``None``
    without a signature, or for arguments it does not take (NumPyro says so later)."""
    try:
        bound = inspect.signature(model).bind(*model_args, **model_kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _arguments_left_none(model, model_args, model_kwargs) -> list[str]:
    """The names of the model's parameters whose value in this call is ``None``."""
    bound = _bound_arguments(model, model_args, model_kwargs) or {}
    return [name for name, value in bound.items() if value is None]


def _children(model, model_args, model_kwargs):
    """``{site: sites whose log-density depends on its value}``, by NumPyro's provenance
    tracking (an abstract trace, no compilation); ``None`` if it cannot trace the model."""
    try:
        prior = get_dependencies(model, tuple(model_args), dict(model_kwargs))["prior_dependencies"]
    except Exception:  # e.g. control flow provenance tracking does not follow
        return None
    children: dict[str, set] = {}
    for downstream, upstreams in prior.items():
        for upstream in upstreams:
            if upstream != downstream:
                children.setdefault(upstream, set()).add(downstream)
    return children


def _message(site, partition, unpassed, is_leaf) -> str:
    name = site["name"]
    frame = _federated_plate_of(site, partition)
    if name in unpassed:
        hint = f"did you forget to pass `{name}`? The model's argument `{name}` is None"
        hint += " and nothing in the model depends on the site" if is_leaf else ""
    else:
        if len(unpassed) == 1:
            hint = f"did you forget to pass `{unpassed[0]}`?"
        elif unpassed:
            hint = "did you forget to pass one of " + ", ".join(f"`{a}`" for a in unpassed) + "?"
        else:
            hint = "did you forget its `obs=`?"
        hint += " Nothing in the model depends on it"
    values = f"{frame.size} values, one per row of the plate"
    if is_leaf:
        consequence = f"it would be sampled from its prior ({values}) and the run would return the prior"
    else:
        consequence = f"it would be sampled as a latent variable ({values}) instead of conditioning on data"
    return (
        f"site '{name}' inside federated_plate '{frame.name}' has no observed value: {hint}, so "
        f"{consequence}. Pass the data with the model's arguments (e.g. `mcmc.run(rng_key, X, y)`); if "
        f"it is meant to be a latent variable, mark it: `numpyro.sample('{name}', ..., "
        f"infer={{'{LATENT_KEY}': True}})`."
    )


# -- validation -----------------------------------------------------------------------------


def tainted_outputs(fn, args, taint_argnum):
    """Which outputs of ``fn(*args)`` depend on ``args[taint_argnum]``, by jaxpr data flow.

    Higher-order primitives (``pjit``, ``scan``...) are treated as a whole: any tainted input
    taints all their outputs, which can only over-report.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    arg_leaves = [jax.tree_util.tree_leaves(a) for a in args]
    offset = sum(len(leaves) for leaves in arg_leaves[:taint_argnum])
    tainted = set(jaxpr.invars[offset : offset + len(arg_leaves[taint_argnum])])

    def is_tainted(var):
        return not isinstance(var, Literal) and var in tainted

    for eqn in jaxpr.eqns:
        if any(is_tainted(v) for v in eqn.invars):
            tainted.update(eqn.outvars)
    flags = [is_tainted(v) for v in jaxpr.outvars]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flags)


def row_argument_names(model, model_args, model_kwargs, plates) -> list[str]:
    """The names of the model's parameters that hold rows (an array whose leading axis has a
    federated data plate's size), for messages; positions (``#0``) without a signature."""
    sizes = {p.size for p in plates.values() if p.holds_data}
    bound = _bound_arguments(model, model_args, model_kwargs)
    if bound is None:
        bound = {f"#{i}": a for i, a in enumerate(model_args)} | dict(model_kwargs)
    return [
        name
        for name, value in bound.items()
        if any(np.ndim(x) >= 1 and np.shape(x)[0] in sizes for x in jax.tree_util.tree_leaves(value))
    ]


def data_free_outputs(server_values, z0, placeholders, row_arguments=()):
    """The outputs of ``server_values`` that do not depend on the rows. The first tracing of
    the model with its row arguments as JAX arrays: a model that computes with them through
    NumPy or Python (``owner[hosp]`` with a NumPy ``owner``, ``if y.sum() > 0``) cannot be
    traced, which is a ``ValueError`` naming the arguments (``row_arguments``) and the remedy,
    not JAX's error."""
    try:
        flags = tainted_outputs(server_values, (z0, placeholders), 1)
    except jax.errors.JAXTypeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ValueError(
            f"the model cannot run on its rows as JAX arrays ({type(exc).__name__}: {first}). Each client's "
            f"functions run the model under jit and vmap with its row arguments ({', '.join(row_arguments)}) traced, "
            "so the model must compute with them through jax.numpy: NumPy or Python on a row argument (e.g. "
            "`owner[hosp]` with a NumPy `owner`, or `if y.sum() > 0`) cannot be traced. Use jnp (e.g. "
            "`jnp.asarray(owner)[hosp]`), or compute the value outside the model and pass it; a federated_plate's "
            "clients= must be computed outside the model"
        ) from exc
    return {name for name, tainted in flags.items() if not tainted}


#: How many initial points :func:`finite_start` tries, as NumPyro's ``find_valid_initial_params``.
MAX_INIT_TRIES = 100


def finite_start(
    model, model_args, model_kwargs, model_trace, latent_sites, enumerated, rng_key, init_strategy, partition, attempt=0
):
    """``(trace, z0, pooled, tries)``: the model's trace at the first of up to
    :data:`MAX_INIT_TRIES` initial points where NumPyro's potential on the pooled data is
    finite: ``model_trace`` (attempt ``attempt`` of :func:`init_traces`, from
    :func:`start_trace`), then the next ones, as NumPyro's MCMC retries its init strategy. A
    prior draw of a coefficient of a raw covariate (ages near 40 under ``Normal(0, 2)``) easily
    overflows an ``exp`` in float32. Where none is finite, the first point, for
    :func:`validate_split` to refuse. ``pooled`` is NumPyro's potential at ``z0``, ``tries``
    how many points were drawn."""
    potential = _pooled_potential(model, model_args, model_kwargs, model_trace, enumerated)
    later = init_traces(model, model_args, model_kwargs, rng_key, init_strategy, partition, first=attempt + 1)
    first = None
    for attempt, model_trace in itertools.chain([(attempt, model_trace)], later):
        z0 = unconstrained_init(model_trace, latent_sites)
        pooled = float(potential(z0))
        if np.isfinite(pooled):
            return model_trace, z0, pooled, attempt + 1
        first = first or (model_trace, z0, pooled)
    return first + (MAX_INIT_TRIES,)


def validate_split(potential, prior_site_log_probs, placeholders, pooled=None, tries=1):
    """Refuses a split whose prior term depends on the rows; with ``pooled`` (NumPyro's
    potential on the pooled data at ``potential.init_params``, from :func:`finite_start`;
    ``None`` in deployment, where there are no rows here) also one whose terms are not finite
    there or do not sum to it."""
    z0 = potential.init_params
    flags = tainted_outputs(prior_site_log_probs, (z0, placeholders), 1)
    dependent = sorted(name for name, tainted in flags.items() if tainted)
    if dependent:
        raise ValueError(
            f"the prior term of site(s) {dependent} depends on client data (model arguments "
            f"{sorted(potential.row_arguments)}): everything outside federated plates must "
            "be computable by the server without the clients' rows"
        )
    if pooled is None:  # deployment: no rows here to compare against NumPyro
        return

    try:
        prior = float(potential.prior_potential(z0))
        clients = np.asarray(potential.client_potentials(z0))
    except Exception as exc:
        raise ValueError(
            "evaluating the per-client view of the model failed. Each client runs the model "
            "on its own rows only, so plate sizes and everything indexed by rows must come "
            "from the model arguments (e.g. `X.shape[0]`), not from constants captured by "
            f"the model. The error was: {type(exc).__name__}: {exc}"
        ) from exc
    split = prior + clients.sum()
    scale = abs(prior) + np.abs(clients).sum() + 1.0
    rtol = 1e-9 if jnp.zeros(()).dtype == jnp.float64 else 1e-4
    if not np.isfinite(split) or not np.isfinite(pooled):
        values = f"prior {prior}, clients {clients.tolist()}, NumPyro {pooled}"
        where = f"the initial point ({values})"
        if tries > 1 and not np.isfinite(pooled):  # no draw was finite (a finite one is kept)
            where = f"any of {tries} initial points the init_strategy drew ({values} at the first)"
        raise ValueError(
            f"the potential is not finite at {where}; try another init_strategy (e.g. init_to_median) or rng_key"
        )
    if abs(split - pooled) > rtol * scale:
        raise ValueError(
            f"the split potential ({split!r}) differs from NumPyro's potential energy "
            f"({pooled!r}) at the initial point. The model probably combines rows of "
            "different clients (an aggregate over all rows, or a row-indexed array that is "
            "not a model argument with rows on its leading axis)."
        )


def _pooled_potential(model, model_args, model_kwargs, model_trace, enumerated):
    """NumPyro's own potential energy on the pooled data (for validation only)."""
    # _prepare_model_for_potential is private, but it is how NumPyro's MCMC prepares a model
    # (enumeration included) for potential_energy; no public function does it.
    from numpyro.infer.util import _prepare_model_for_potential, potential_energy

    prepared = _prepare_model_for_potential(model, model_trace, enum=enumerated)
    return jax.jit(lambda z: potential_energy(prepared, model_args, model_kwargs, z, enum=enumerated))
