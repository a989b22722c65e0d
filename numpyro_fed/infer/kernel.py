"""What every MCMC kernel of the project shares: the NumPyro face over a pure core.

A sampler of this project is a :class:`~numpyro.infer.mcmc.MCMCKernel` whose ``init``
splits the model's potential (:meth:`FederatedMCMCKernel.init_potential`), builds the
algorithm's pure ``step(rng_key, state, ...) -> (state, info)`` and keeps NumPyro's
``_sample_fn``; the rest is here, written once:

* :meth:`FederatedMCMCKernel.check_run`, the one path by which a run's problems reach the
  user: the subclass lists them (:meth:`~FederatedMCMCKernel.diagnose`), this method warns
  (or raises with ``strict``). It runs at the end of every ``MCMC.run``, so that a user who
  stays with ``mcmc.get_samples()`` hears what went wrong, and
  :func:`~numpyro_fed.to_inference_data` calls it again;
* the hooks :func:`~numpyro_fed.to_inference_data` reads on an MCMC run:
  :attr:`~FederatedMCMCKernel.federated_potential` (the federation's attributes),
  :meth:`~FederatedMCMCKernel.sample_stats` (the diagnostics of the core's ``info``,
  recorded as extra fields ``"info.<name>"``), :meth:`~FederatedMCMCKernel.extra_groups`
  (draws beside the posterior's) and :attr:`~FederatedMCMCKernel.privacy`;
* ``partition`` and ``init_strategy`` handed to :func:`~numpyro_fed.split_potential` the
  same way for every algorithm (:meth:`~FederatedMCMCKernel.init_potential`, through
  :func:`~numpyro_fed.infer.base.build_potential`); ``model``, ``sample``, ``postprocess_fn``;
* a readable ``repr`` that names the model and the arguments that differ from their
  defaults.

**Adding a sampler**: subclass :class:`FederatedMCMCKernel`, set :attr:`info_names` to the
fields of the core's info namedtuple, write ``init`` (call :meth:`init_potential`, which also
arms the end-of-run check, build the
core, set ``self._sample_fn``, return the first state, whose ``info`` field holds the last
step's info) and, if the run can go wrong in ways the user must hear about,
:meth:`diagnose`.

>>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
>>> from typing import NamedTuple
>>> from numpyro.infer import MCMC
>>> import numpyro_fed as nf
>>> from numpyro_fed.infer.kernel import FederatedMCMCKernel, RunCheck
>>> class State(NamedTuple):
...     i: jax.Array
...     z: dict
...     info: tuple
...     rng_key: jax.Array
>>> class Info(NamedTuple):
...     size: jax.Array
>>> class RandomWalk(FederatedMCMCKernel):
...     '''A (biased) random walk: not a sampler, just the smallest face there is.'''
...     info_names = Info._fields
...     def __init__(self, model, *, scale=0.1, partition=None):
...         super().__init__(model, partition=partition)
...         self.scale = scale
...     def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
...         potential = self.init_potential(rng_key, model_args, model_kwargs)
...         def sample(state):
...             k_next, k_move = jax.random.split(state.rng_key)
...             flat = potential.ravel(state.z)
...             move = self.scale * jax.random.normal(k_move, flat.shape)
...             return State(state.i + 1, potential.unravel(flat + move),
...                          Info(jnp.linalg.norm(move)), k_next)
...         self._sample_fn = sample
...         return State(jnp.zeros((), int), potential.init_params, Info(jnp.zeros(())), rng_key)
...     def diagnose(self, mcmc):
...         return RunCheck(["it is a random walk, not a sampler"], None)
>>> def model(y):
...     mu = numpyro.sample("mu", dist.Normal(0, 1))
...     with nf.federated_plate("data", y.shape[0], clients=2):
...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
>>> kernel = RandomWalk(model, scale=0.5)
>>> kernel
RandomWalk(model=model, scale=0.5)
>>> mcmc = MCMC(kernel, num_warmup=0, num_samples=10, progress_bar=False)
>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     mcmc.run(jax.random.PRNGKey(0), jnp.zeros(4), extra_fields=("info.size",))
>>> [str(w.message) for w in caught]  # at the end of the run
['RandomWalk: it is a random walk, not a sampler']
>>> mcmc.get_samples()["mu"].shape, kernel.sample_stats(mcmc.get_extra_fields(group_by_chain=True))["size"][0].shape
((10,), (1, 10))
>>> kernel.check_run(mcmc, strict=True)
Traceback (most recent call last):
...
RuntimeError: RandomWalk: it is a random walk, not a sampler
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, NamedTuple

import numpy as np

import jax

from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMC, MCMCKernel
from numpyro.util import is_prng_key

from numpyro_fed._checks import warn_user
from numpyro_fed.infer.base import build_potential, check_federation
from numpyro_fed.potential import FederatedPotential

__all__ = ["FederatedMCMCKernel", "RunCheck", "RunEndCheck", "calling_mcmc", "warn_or_raise"]


class RunCheck(NamedTuple):
    """What :meth:`FederatedMCMCKernel.diagnose` found in a run.

    :ivar problems: messages, each one thing that went wrong and what to change (empty: all
        is well); :meth:`~FederatedMCMCKernel.check_run` joins them after the sampler's name.
    :ivar result: what :meth:`~FederatedMCMCKernel.check_run` returns (e.g. counts).
    """

    problems: list
    result: Any


def warn_or_raise(message: str, *, strict: bool = False, stacklevel: int = 3) -> None:
    """The one way a run's problem reaches the user: a ``RuntimeWarning``, or a
    ``RuntimeError`` when ``strict``.

    >>> warn_or_raise("FedZigZag: 3 capped samples", strict=True)
    Traceback (most recent call last):
    ...
    RuntimeError: FedZigZag: 3 capped samples
    """
    if strict:
        raise RuntimeError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def calling_mcmc():
    """The ``MCMC`` whose ``run`` is on the stack (it calls the kernel's ``init``), or ``None``
    (a kernel used without NumPyro's ``MCMC``)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, MCMC):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


class RunEndCheck:
    """Runs the kernel's :meth:`~FederatedMCMCKernel.check_run` when an ``MCMC.run`` ends.

    NumPyro's ``MCMC`` has no hook at the end of a run; its ``run`` ends by resetting its
    collection parameters (``_set_collection_params()``, no arguments), after it has stored the
    draws. This object stands in for that method on one ``MCMC`` instance (an attribute of the
    instance, so other runs are untouched; an object, not a closure), calls NumPyro's own,
    then the check, unless the run was ``MCMC.warmup``'s. A test of the project fails if a
    NumPyro release changes this."""

    def __init__(self, mcmc, kernel):
        self.mcmc, self.kernel = mcmc, kernel

    def __call__(self, *args, **kwargs):
        mcmc = self.mcmc
        ending = not args and not kwargs and mcmc._collection_params.get("phase") != "warmup"
        type(mcmc)._set_collection_params(mcmc, *args, **kwargs)
        if ending and mcmc.sampler is self.kernel and getattr(mcmc, "_states", None) is not None:
            self.kernel.check_run(mcmc)

    @classmethod
    def arm(cls, kernel) -> None:
        """Arms the check on the ``MCMC`` running ``kernel`` (if any; once per instance)."""
        mcmc = calling_mcmc()
        if mcmc is not None and not isinstance(vars(mcmc).get("_set_collection_params"), cls):
            mcmc._set_collection_params = cls(mcmc, kernel)


class FederatedMCMCKernel(MCMCKernel):
    """Base class of the project's MCMC kernels (see the module's docstring for the recipe).

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`.
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: NumPyro init strategy of the potential's initial point
        (:attr:`FederatedPotential.init_params`).
    :param federation: where the clients run (``None``: :class:`~numpyro_fed.federation.InProcess`,
        every client in this process), as for every algorithm.
    """

    #: names of the fields of the core's info namedtuple; the face records them as extra
    #: fields ``"info.<name>"`` and :meth:`sample_stats` reports them
    info_names: tuple = ()
    #: the dim of a per-client diagnostic (a third axis after chain and draw)
    client_dim: str = "client"
    #: the run's privacy guarantee (a :class:`~numpyro_fed.privacy.PrivacyGuarantee`), if any
    privacy = None

    def __init__(self, model, *, partition=None, init_strategy=init_to_uniform, federation=None):
        self._model = model
        self.partition = partition
        self.init_strategy = init_strategy
        #: where the clients run: a :class:`~numpyro_fed.federation.Federation`; ``None``
        #: gives :class:`~numpyro_fed.federation.InProcess` (every algorithm's meaning of ``None``)
        self.federation = check_federation(federation)
        self._default_federation = federation is None
        #: the :class:`~numpyro_fed.FederatedPotential` of the last ``init`` (``None`` before)
        self.federated_potential: FederatedPotential | None = None
        self._sample_fn = None  # NumPyro's MCMC calls init() again while this is None

    # -- set-up -----------------------------------------------------------------------------
    def init_potential(
        self, rng_key, model_args, model_kwargs, *, global_latents_only: str | None = None, advice: str = ""
    ) -> FederatedPotential:
        """Splits the model's potential with this kernel's ``partition`` and
        ``init_strategy`` (through :func:`~numpyro_fed.infer.base.build_potential`, as every
        algorithm does) and keeps it as :attr:`federated_potential`.

        :param rng_key: a key, or one key per chain (``chain_method="vectorized"``): the first
            one seeds the initial point.
        :param str global_latents_only: the sampler's name if it infers global latents only
            (then client-local sites are refused, with ``advice``).
        """
        if not is_prng_key(rng_key):
            rng_key = rng_key[0]
        potential = build_potential(
            self._model,
            model_args,
            model_kwargs,
            partition=self.partition,
            init_strategy=self.init_strategy,
            rng_key=rng_key,
            global_latents_only=global_latents_only,
            advice=advice,
            federation=getattr(self, "federation", None),
        )
        self.federated_potential = potential
        RunEndCheck.arm(self)
        return potential

    # -- MCMCKernel -------------------------------------------------------------------------
    @property
    def model(self):
        return self._model

    @property
    def sample_field(self):
        return "z"

    def sample(self, state, model_args, model_kwargs):
        """One MCMC sample: the compiled core's step on ``state`` (``model_args`` are those of
        ``init``, already inside the core)."""
        return self._sample_fn(state)

    def postprocess_fn(self, model_args, model_kwargs):
        if self.federated_potential is None:
            raise RuntimeError(f"{type(self).__name__}.postprocess_fn needs init() to have run")
        return self.federated_potential.postprocess_fn

    def get_diagnostics_str(self, state):
        return ""

    # -- checks -----------------------------------------------------------------------------
    def diagnose(self, mcmc, **options) -> RunCheck:
        """What went wrong in ``mcmc``'s run, if anything (override; the default finds
        nothing)."""
        return RunCheck([], None)

    def check_run(self, mcmc, *, strict: bool = False, **options):
        """Warns (``RuntimeWarning``, attributed to the user's line), or raises
        ``RuntimeError`` with ``strict``, when the run of ``mcmc`` went wrong, naming what to
        change; every problem :meth:`diagnose` finds in one message. Called at the end of
        every ``MCMC.run`` (:class:`RunEndCheck`) and by :func:`~numpyro_fed.to_inference_data`.

        :param options: passed to :meth:`diagnose` (e.g. ``min_ess`` of
            :class:`~numpyro_fed.FedZigZag`).
        :return: the ``result`` of :meth:`diagnose` (see the sampler's own documentation).
        """
        found = self.diagnose(mcmc, **options)
        if found.problems:
            message = f"{type(self).__name__}: " + "; ".join(found.problems)
            if strict:
                warn_or_raise(message, strict=True)
            else:
                warn_user(message, RuntimeWarning)
        return found.result

    # -- what to_inference_data reads -------------------------------------------------------
    def sample_stats(self, extra_fields) -> dict:
        """Diagnostics by name from ``MCMC.get_extra_fields(group_by_chain=True)``:
        ``{name: (array, dims)}`` for every ``"info.<name>"`` recorded, a per-client one
        (a third axis) with the dim :attr:`client_dim`."""
        stats = {}
        for name in self.info_names:
            value = extra_fields.get("info." + name)
            if value is None:
                continue
            value = np.asarray(jax.device_get(value))
            stats[name] = (value, [self.client_dim] if value.ndim == 3 else [])
        return stats

    def extra_groups(self, mcmc) -> dict:
        """Groups :func:`~numpyro_fed.to_inference_data` adds beside ``posterior``:
        ``{group: (values_by_site, leading_dims)}``, each value ``(chain, draw,
        *leading, *site_shape)`` (default: none)."""
        return {}

    def message_ledger(self, mcmc) -> dict:
        """What crossed the wire in ``mcmc``'s run, per client (or agent): ``{name: (M,)
        array}`` in the shape of :meth:`MessageLedger.summary
        <numpyro_fed.federation.MessageLedger.summary>` (see
        :func:`numpyro_fed.message_ledger`, the accessor for every run). A sampler that
        sends messages overrides it."""
        raise NotImplementedError(f"{type(self).__name__} does not count its messages")

    # -- repr -------------------------------------------------------------------------------
    def hyperparameters(self) -> dict:
        """The constructors' arguments that differ from their defaults, by name (those
        stored under their own name): what ``repr`` shows."""
        values = {}
        for cls in type(self).__mro__:
            if "__init__" not in cls.__dict__ or cls in (FederatedMCMCKernel, MCMCKernel, object):
                continue
            for name, parameter in inspect.signature(cls.__init__).parameters.items():
                if (
                    name in ("self", "model")
                    or name in values
                    or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
                    or not hasattr(self, name)
                ):
                    continue
                values[name] = (getattr(self, name), parameter.default)
        for name in ("partition", "init_strategy"):
            values.setdefault(name, (getattr(self, name), None if name == "partition" else init_to_uniform))
        if getattr(self, "_default_federation", False):
            values.pop("federation", None)  # None was given: the InProcess it means is the default
        return {name: value for name, (value, default) in values.items() if not _same(value, default)}

    def __repr__(self) -> str:
        model = getattr(self._model, "__name__", repr(self._model))
        arguments = [f"model={model}"] + [f"{k}={_short(v)}" for k, v in self.hyperparameters().items()]
        return f"{type(self).__name__}({', '.join(arguments)})"


def _same(value, default) -> bool:
    if default is inspect.Parameter.empty:
        return False
    if value is default:
        return True
    try:
        return bool(np.all(value == default)) and np.shape(value) == np.shape(default)
    except Exception:  # noqa: BLE001 - incomparable objects are different
        return False


def _short(value) -> str:
    if hasattr(value, "shape") and np.ndim(value) > 0:
        return f"<array {tuple(np.shape(value))}>"
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    return repr(value)
