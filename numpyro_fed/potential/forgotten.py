"""What a user forgets: an observed site inside a federated plate given ``obs=None``.

In NumPyro a sample site given ``obs=None`` is an ordinary latent site. Inside a federated
plate it would become one latent value per row of the plate, sampled from its prior: the run
would return the prior without a word (a discrete site would even be enumerated away). What
tells such a site from a legitimate client-local latent (a per-row effect ``eta_i``, a mixture
assignment ``z_i``, a per-group effect ``u_g``) is that nothing in the model depends on it, or
that it bears the name of a model argument left ``None``. :func:`check_observations` refuses
such a site, before any work, with a ``ValueError`` naming the site and the argument to pass,
unless the site asks to be sampled: ``infer={"federated_latent": True}``.
"""

from __future__ import annotations

import inspect

from numpyro.infer.inspect import get_dependencies

from numpyro_fed.plate import FEDERATED_KEY

__all__ = ["LATENT_KEY", "check_observations"]

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
    for site in candidates:
        if site["name"] in unpassed:
            raise ValueError(_message(site, partition, [site["name"]]))
    children = _children(model, model_args, model_kwargs)
    if children is None:  # the model's dependencies could not be traced: the name rule only
        return
    for site in candidates:
        if not children.get(site["name"]):
            raise ValueError(_message(site, partition, unpassed))


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


def _arguments_left_none(model, model_args, model_kwargs) -> list[str]:
    """The names of the model's parameters whose value in this call is ``None``."""
    try:
        bound = inspect.signature(model).bind(*model_args, **model_kwargs)
    except (TypeError, ValueError):  # no signature, or arguments it does not take (NumPyro says so later)
        return []
    bound.apply_defaults()
    return [
        name
        for name, value in bound.arguments.items()
        if value is None and bound.signature.parameters[name].kind not in (inspect.Parameter.VAR_POSITIONAL,)
    ]


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


def _message(site, partition, unpassed) -> str:
    name = site["name"]
    frame = _federated_plate_of(site, partition)
    if name in unpassed:
        hint = f"did you forget to pass `{name}`?"
        why = f"The model's argument `{name}` is None"
    else:
        if len(unpassed) == 1:
            hint = f"did you forget to pass `{unpassed[0]}`?"
        elif unpassed:
            hint = "did you forget to pass one of " + ", ".join(f"`{a}`" for a in unpassed) + "?"
        else:
            hint = "did you forget its `obs=`?"
        why = "Nothing in the model depends on it"
    return (
        f"site '{name}' inside federated_plate '{frame.name}' has no observed value: {hint} "
        f"{why}, so it would be sampled from its prior ({frame.size} values, one per row of the "
        "plate) and the run would return the prior. Pass the data with the model's arguments "
        "(e.g. `mcmc.run(rng_key, X, y)`); if it is meant to be a latent variable, mark it: "
        f"`numpyro.sample('{name}', ..., infer={{'{LATENT_KEY}': True}})`."
    )
