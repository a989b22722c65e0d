"""What every algorithm's face shares: the way into the model, the run driver, the result.

* :func:`build_potential`: the one way a face calls :func:`~numpyro_fed.split_potential`
  (``partition`` and ``init_strategy`` passed through), with :func:`check_global_latents`,
  the one check (and message) for methods that infer global latent variables only. The core
  then works on :meth:`FederatedPotential.flat() <numpyro_fed.FederatedPotential.flat>`.
* :func:`run_rounds`: the one round driver: a key per round, the progress bar, per-round
  metrics stacked into numpy arrays, and the non-finite (divergence) check.
* :class:`RunResult` and :class:`VariationalMethod`: the result and the face of every
  variational method, mirroring :class:`numpyro.infer.SVI` (``init``, ``update``, ``run``,
  ``get_samples``, ``evaluate``). ``nf.to_inference_data(result)`` dispatches to the
  method's :meth:`~VariationalMethod.arviz_dicts`.

See ``docs/guide/architecture.md`` for the whole shape and a walkthrough that adds an
algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import jax

from numpyro.infer.initialization import init_to_uniform

from numpyro_fed._checks import check_int
from numpyro_fed.arviz import register_converter
from numpyro_fed.infer.rounds import RunCheckpoint, run_rounds
from numpyro_fed.potential import FederatedPotential, split_potential

__all__ = [
    "ClientSpec",
    "adopt_client_state",
    "RunResult",
    "VariationalMethod",
    "build_potential",
    "check_federation",
    "check_global_latents",
    "jit_round",
]


def check_global_latents(potential: FederatedPotential, method: str, advice: str = "") -> None:
    """Raises a ``ValueError`` naming the client-local latent sites of ``potential``, for a
    ``method`` that infers global latent variables only (``advice`` is appended)."""
    local = [name for name, owner in potential.coordinate_owner_tree.items() if (np.asarray(owner) >= 0).any()]
    if local:
        raise ValueError(
            f"{method} infers global latent variables only; site(s) {local} are client-local "
            f"(inside a federated plate){': ' + advice if advice else ''}"
        )


def build_potential(
    model: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    partition=None,
    init_strategy: Callable = init_to_uniform,
    rng_key=None,
    global_latents_only: str | None = None,
    advice: str = "",
    federation=None,
) -> FederatedPotential:
    """:func:`~numpyro_fed.split_potential` as every algorithm's face calls it.

    :param global_latents_only: the method's name if it infers global latents only: then
        :func:`check_global_latents` runs (with ``advice``).
    :param federation: the algorithm's :class:`~numpyro_fed.federation.Federation`. One with
        a ``loader`` (deployment) gives the rows: then ``args`` and ``kwargs`` must be empty,
        the loaders run where the clients live and the potential holds no row
        (:attr:`FederatedPotential.deployed <numpyro_fed.FederatedPotential.deployed>`).
    """
    if federation is not None and getattr(federation, "deployed", False):
        if tuple(args) or dict(kwargs or {}):
            raise ValueError(
                f"{type(federation).__name__} was given loader= (deployment: each client loads its "
                "own rows), so run the algorithm without data arguments (the model's arguments "
                "come from the loaders)"
            )
        potential = split_potential(
            model,
            partition=partition,
            init_strategy=init_strategy,
            rng_key=rng_key,
            loader=federation.loader,
            num_clients=federation.loader_num_clients,
            federation=federation,
        )
    else:
        potential = split_potential(
            model, tuple(args), dict(kwargs or {}), partition=partition, init_strategy=init_strategy, rng_key=rng_key
        )
    if global_latents_only is not None:
        check_global_latents(potential, global_latents_only, advice)
    return potential


def check_federation(federation):
    """``federation`` as a :class:`~numpyro_fed.federation.Federation`: ``None`` gives a new
    :class:`~numpyro_fed.federation.InProcess`; anything else that is not a federation is a
    ``TypeError``."""
    from numpyro_fed.federation import Federation, InProcess

    if federation is None:
        return InProcess()
    if not isinstance(federation, Federation):
        raise TypeError(
            f"federation must be a numpyro_fed Federation (e.g. nf.InProcess() or "
            f"nf.RayFederation()), got {type(federation).__name__}"
        )
    return federation


def adopt_client_state(federation, clients):
    """The :class:`~numpyro_fed.federation.ClientState` ``clients`` of a state a run is
    continued from (``init_state=``), on the started ``federation``: as it is when its values
    are where the federation expects them (in this process for
    :class:`~numpyro_fed.federation.InProcess`, on the workers otherwise); values held in
    this process (e.g. a state built by hand, or an in-process run's) are handed to the
    clients of an engine backend with its ``init_state``. A state whose values are on the
    workers of another federation cannot be continued in process: a ``ValueError`` says so."""
    has_values = bool(jax.tree_util.tree_leaves(clients.values))
    if federation.in_process:
        if not has_values:
            raise ValueError(
                "init_state's client state is held by the workers of the federation that ran it "
                "(an engine backend): continue the run on that federation"
            )
        return clients
    return federation.init_state(clients.values) if has_values else clients


class jit_round:
    """``jax.jit`` of a round ``step(*args, federation)`` whose last argument is a started
    :class:`~numpyro_fed.federation.Federation`: one that is a pytree (``InProcess``, whose
    leaves are the clients' blocks) is passed as an argument, so its blocks are not baked into
    the compiled code; any other (``RayFederation``, host callbacks) is closed over, one
    compiled program per federation."""

    def __init__(self, step: Callable):
        self.step = step
        self._dynamic = jax.jit(step)
        self._static = {}

    def __call__(self, *args):
        *rest, federation = args
        if jax.tree_util.tree_leaves(federation) != [federation]:
            return self._dynamic(*rest, federation)
        fn = self._static.get(id(federation))
        if fn is None:
            step = self.step
            fn = self._static[id(federation)] = jax.jit(lambda *a: step(*a, federation))
        return fn(*rest)


class RunResult(NamedTuple):
    """What every variational method's ``run`` returns.

    :ivar state: the final state (the method's own NamedTuple; pass it as ``init_state`` to
        continue).
    :ivar dict metrics: per-round numpy arrays (leading axis ``num_rounds``): ``loss`` where
        the method defines one (see its ``evaluate``), ``wall_time`` and the method's own
        diagnostics.
    :ivar privacy: the run's :class:`~numpyro_fed.privacy.PrivacyGuarantee`, or ``None``.
    :ivar method: the :class:`VariationalMethod` that ran it: ``nf.to_inference_data(result)``
        and ``result.method.get_samples(rng_key, result)`` need nothing else.
    :ivar dict ledger: what crossed between the server and the clients in the run
        (:meth:`MessageLedger.summary() <numpyro_fed.federation.MessageLedger.summary>`: per
        client, per call and direction, messages, bytes and rounds): the algorithm's
        messages only, since what a client keeps between its rounds stays with it (see
        :class:`~numpyro_fed.federation.ClientState`). ``None`` for a method that does not
        report one.
    """

    state: Any
    metrics: dict
    privacy: Any
    method: Any
    ledger: dict | None = None


class ClientSpec(NamedTuple):
    """What a method's clients run (:meth:`VariationalMethod.plan_clients`).

    :ivar dict functions: name -> ``f(block, *args)``, what a client answers.
    :ivar blocks: simulation-only methods: the clients' stacked blocks, cut in this process
        (``None``: each client's block is its own rows, built where it lives in deployment).
    :ivar transform: a picklable ``block -> block`` run where the client lives (the method's
        own layout of the rows), or ``None``.
    :ivar dict stateful: name -> ``f(block, state, *args) -> (state, reply)``, the calls of the
        client's own state (see :class:`~numpyro_fed.federation.ClientState`).
    :ivar dict timeouts: name -> seconds a call may take on an engine, in place of the
        federation's ``timeout`` (see :class:`~numpyro_fed.federation.ClientProgram`).
    """

    functions: dict
    blocks: Any = None
    transform: Callable | None = None
    stateful: dict | None = None
    timeouts: dict | None = None


class VariationalMethod:
    """The face of a variational method, as :class:`numpyro.infer.SVI`: ``init``,
    ``update`` (one round), ``run``, ``get_samples``, ``evaluate``.

    A subclass implements :meth:`init`, :meth:`update` and :meth:`get_samples` (and
    :meth:`evaluate` where it has a loss); :meth:`run` drives the rounds with
    :func:`run_rounds`. Extension points, each optional: :meth:`record` (a round's metrics),
    :meth:`finish` (checks and warnings on the finished run), :meth:`arviz_dicts` (what
    ``nf.to_inference_data`` shows) and :attr:`repr_fields`. See
    ``docs/guide/architecture.md`` for a complete small method.

    :param model: a NumPyro model with a :func:`~numpyro_fed.federated_plate`.
    :param partition: as :func:`~numpyro_fed.split_potential`.
    :param init_strategy: as :func:`~numpyro_fed.split_potential`.
    :param bool progress_bar: a progress bar over rounds.
    """

    #: constructor arguments shown by ``repr`` (besides the model).
    repr_fields: tuple = ()
    #: what to change when a run diverges (in the ``FloatingPointError``).
    divergence_advice: str = ""

    def __init__(
        self, model, *, partition=None, init_strategy=init_to_uniform, progress_bar: bool = True, federation=None
    ):
        if not callable(model):
            raise TypeError(f"model must be a callable NumPyro model, got {type(model).__name__}")
        self.model = model
        self.federation = check_federation(federation)
        self.partition = partition
        self.init_strategy = init_strategy
        self.progress_bar = bool(progress_bar)
        self.federated_potential: FederatedPotential | None = None

    # -- the model ---------------------------------------------------------------------------
    def build_potential(self, args, kwargs, *, global_latents_only: bool = True, advice: str = ""):
        """Splits the model on these arguments (:func:`build_potential` with this method's
        ``partition`` and ``init_strategy``) and keeps it as :attr:`federated_potential`."""
        self.federated_potential = build_potential(
            self.model,
            args,
            kwargs,
            partition=self.partition,
            init_strategy=self.init_strategy,
            global_latents_only=type(self).__name__ if global_latents_only else None,
            advice=advice,
            federation=self.federation,
        )
        return self.federated_potential

    # -- to implement ------------------------------------------------------------------------
    def init(self, rng_key, *args, **kwargs):
        """The initial state for the model's arguments ``args``, ``kwargs`` (the data)."""
        raise NotImplementedError

    def update(self, rng_key, state, *args, **kwargs):
        """One round: ``(state, info)``."""
        raise NotImplementedError

    def get_samples(self, rng_key, result: RunResult, num_samples: int | None = None) -> dict:
        """Constrained draws of the fitted approximation, by site."""
        raise NotImplementedError

    def evaluate(self, state, *args, **kwargs):
        """The loss of ``state`` (e.g. the negative ELBO), where the method defines one."""
        raise NotImplementedError(f"{type(self).__name__} defines no loss")

    # -- extension points --------------------------------------------------------------------
    def record(self, state, info) -> dict:
        """A round's metrics (default: the fields of ``info``)."""
        if info is None:
            return {}
        items = info._asdict() if hasattr(info, "_asdict") else dict(info)
        return {k: v for k, v in items.items() if v is not None}

    def finish(self, result: RunResult) -> RunResult:
        """Checks (and warnings) on a finished run; may add metrics (default: none)."""
        return result

    # -- the federation --------------------------------------------------------------------
    def run_ledger(self, federation, previous: dict | None = None, baseline: dict | None = None) -> dict:
        """``federation``'s ledger summary (see :attr:`RunResult.ledger`) less ``baseline``
        (the summary before the run), plus ``previous`` (the ledger of a run's rounds before
        an interruption)."""
        # the initial client state (public values, sent once as "init_state" when the run
        # set up) is in the federation's ledger, not in the run's messages
        out = {k: v for k, v in federation.ledger.since(baseline).items() if not k.startswith("init_state/")}
        for key, value in (previous or {}).items():
            out[key] = out.get(key, 0) + np.asarray(value)
        return out

    def through_clients(self, fn, ledger: dict | None = None):
        """``fn()`` (a computation after the rounds that asks the clients, e.g. a check of the
        run) under the active federation's guard, its values on the host; given a run's
        ``ledger`` (:attr:`RunResult.ledger`, updated in place), the calls the federation
        counted in ``fn`` are added to it."""
        federation = self._active_federation
        before = federation.ledger.summary()
        with federation.guard():
            out = jax.tree.map(np.asarray, fn())
        if ledger is not None:
            for key, value in self.run_ledger(federation, baseline=before).items():
                ledger[key] = ledger.get(key, 0) + value
        return out

    def arviz_dicts(self, result: RunResult, *, num_samples: int | None = None, rng_key=None) -> dict:
        """The keyword arguments of :func:`numpyro_fed.arviz.from_dicts` for this result
        (plain arrays): ``posterior`` (one chain of :meth:`get_samples`), ``sample_stats``
        (every per-round metric, dim ``round`` first, and the message ledger,
        ``ledger.<call>.<count>``, dim ``client``), ``coords``, ``attrs`` and ``dims`` (a
        site's plates, as NumPyro's MCMC conversion names them)."""
        from numpyro_fed.arviz import federation_attrs

        rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        draws = self.get_samples(rng_key, result, num_samples)
        posterior = {k: np.asarray(v)[None] for k, v in draws.items()}
        sample_stats = {}
        for name, value in result.metrics.items():
            value = np.asarray(value)
            sample_stats[name] = (value, ["round"] + [f"{name}_dim_{j}" for j in range(value.ndim - 1)])
        num_rounds = len(next(iter(result.metrics.values()), []))
        coords = {"round": np.arange(1, num_rounds + 1)}
        sample_stats.update(ledger_stats(result.ledger))
        if result.ledger:
            coords["client"] = np.arange(len(next(iter(result.ledger.values()))))
        attrs = {"algorithm": type(self).__name__}
        attrs.update({name: _attr(getattr(self, name)) for name in self.repr_fields})
        if self.federated_potential is not None:
            attrs.update(federation_attrs(self.federated_potential))
        if result.privacy is not None:
            attrs.update(result.privacy.as_attrs())
        if self.federation is not None:
            attrs["federation"] = type(self.federation).__name__
        dims = {} if self.federated_potential is None else dict(self.federated_potential.site_dims)
        return {"posterior": posterior, "sample_stats": sample_stats, "coords": coords, "attrs": attrs, "dims": dims}

    # -- the driver --------------------------------------------------------------------------
    def plan_clients(self, rng_key, args, kwargs, *, num_rounds: int | None = None) -> ClientSpec:
        """What this method's clients run in a run of ``num_rounds`` rounds on the model's
        arguments ``args``, ``kwargs`` (the data; none in deployment): splits the model and
        returns a :class:`ClientSpec`. ``init`` starts the clients on it; a Flower node builds
        the same program from it with the app's own code (:meth:`client_program`), so no
        code crosses the wire. ``rng_key`` is :meth:`init`'s key. Every method implements it."""
        raise NotImplementedError(f"{type(self).__name__} does not declare its clients' program (plan_clients)")

    def init_key(self, rng_key):
        """The key :meth:`run` gives :meth:`init` (and :meth:`plan_clients`)."""
        return jax.random.split(rng_key)[0]

    def client_program(self, rng_key, num_rounds: int | None, *args, **kwargs):
        """The :class:`~numpyro_fed.federation.ClientProgram` that ``run(rng_key, num_rounds,
        *args, **kwargs)`` starts its clients on: the functions every client runs and where
        its rows come from (its block, or a loader run where it lives in deployment). An
        engine starts it on its workers; a Flower node builds it with the app's code from the
        shapes the nodes described. No client is started."""
        spec = self.plan_clients(self.init_key(rng_key), args, kwargs, num_rounds=num_rounds)
        return self.program_of(spec)

    def program_of(self, spec: ClientSpec):
        """The :class:`~numpyro_fed.federation.ClientProgram` of ``spec`` on
        :attr:`federated_potential`'s clients."""
        from numpyro_fed.federation import ClientProgram

        stateful, timeouts = dict(spec.stateful or {}), dict(spec.timeouts or {})
        if spec.blocks is not None:
            if self.federation.deployed:
                raise ValueError(
                    f"{type(self).__name__} gives its clients blocks cut in this process: it runs in "
                    "simulation only, not in deployment"
                )
            return ClientProgram.stacked(spec.functions, spec.blocks, stateful=stateful, timeouts=timeouts)
        return self.federated_potential.client_program(
            spec.functions, transform=spec.transform, stateful=stateful, timeouts=timeouts
        )

    def start_clients(
        self,
        functions: dict,
        blocks=None,
        transform: Callable | None = None,
        stateful: dict | None = None,
        timeouts: dict | None = None,
    ):
        """Starts :attr:`federation` for this run on the program of :class:`ClientSpec`
        ``(functions, blocks, transform, stateful, timeouts)`` (see :meth:`program_of`) and returns it.
        In a federation already started (by a previous run, possibly stopped by a fault), the
        workers that do not answer are first replaced (its ``restart()``)."""
        if self.federation.started:
            self.federation.restart()
        program = self.program_of(ClientSpec(functions, blocks, transform, stateful, timeouts))
        self._active_federation = self.federation.start(program)
        return self._active_federation

    def drive(
        self,
        update: Callable,
        rng_key,
        state,
        num_rounds: int,
        *,
        resume=None,
        privacy=None,
        is_finite: Callable | None = None,
        desc: str | None = None,
        context: dict | None = None,
        ledger: dict | None = None,
    ) -> RunResult:
        """:func:`run_rounds` with this method's settings, its federation's guard and ledger:
        the :class:`RunResult` before :meth:`finish`. ``resume``: a :class:`RunCheckpoint` to
        continue. ``ledger``: the calls a fresh run made before its rounds (a set-up's), counted
        in its ledger. A :class:`~numpyro_fed.federation.ClientError` gets ``error.state`` (the
        checkpoint, whose context holds ``context`` and the ledger so far) and
        ``error.result`` (the rounds completed, a :class:`RunResult`); so does the
        ``FloatingPointError`` of a run that diverged."""
        from numpyro_fed.federation import ClientError

        federation = getattr(self, "_active_federation", None)
        previous = ledger if resume is None else resume.context.get("ledger")
        baseline = None if federation is None else federation.ledger.summary()
        context = dict(resume.context if resume is not None else (context or {}))
        try:
            state, metrics = run_rounds(
                update,
                rng_key,
                state,
                num_rounds,
                record=self.record,
                is_finite=is_finite,
                progress_bar=self.progress_bar,
                desc=desc or type(self).__name__,
                divergence_advice=self.divergence_advice,
                resume=resume,
                context=context,
                guard=None if federation is None else federation.guard,
            )
        except (ClientError, FloatingPointError) as error:
            checkpoint = getattr(error, "state", None)
            if isinstance(checkpoint, RunCheckpoint):
                ledger = None if federation is None else self.run_ledger(federation, previous, baseline)
                error.state = checkpoint._replace(context=dict(checkpoint.context, ledger=ledger))
                error.result = RunResult(checkpoint.state, checkpoint.metrics, privacy, self, ledger)
            raise
        ledger = None if federation is None else self.run_ledger(federation, previous, baseline)
        return RunResult(state, metrics, privacy, self, ledger)

    def run(self, rng_key, num_rounds: int, *args, init_state=None, **kwargs) -> RunResult:
        """Runs ``num_rounds`` rounds from :meth:`init`'s state (or ``init_state``).

        :param rng_key: a JAX PRNG key: split into the key of :meth:`init` and those of
            the rounds.
        :param int num_rounds: rounds to run.
        :param args, kwargs: the model's arguments (the data).
        :param init_state: continue from this state (e.g. a previous ``result.state``);
            :meth:`init` still runs (it splits the model on these arguments) and its state
            is replaced. A :class:`RunCheckpoint` (``error.state`` of a run stopped by a
            :class:`~numpyro_fed.federation.ClientError`) resumes that run: give it the
            same ``rng_key`` and ``num_rounds``.
        """
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        key_init, key_run = jax.random.split(rng_key)
        state = self.init(key_init, *args, **kwargs)
        resume = init_state if isinstance(init_state, RunCheckpoint) else None
        if init_state is not None:
            state = init_state.state if resume is not None else init_state
            federation = getattr(self, "_active_federation", None)
            clients = getattr(state, "clients", None)
            if resume is None and federation is not None and clients is not None:
                state = state._replace(clients=adopt_client_state(federation, clients))
        result = self.drive(
            lambda key, s: self.update(key, s, *args, **kwargs), key_run, state, num_rounds, resume=resume
        )
        return self.finish(result)

    def __repr__(self) -> str:
        model = getattr(self.model, "__name__", type(self.model).__name__)
        fields = [f"{name}={getattr(self, name)!r}" for name in self.repr_fields]
        return f"{type(self).__name__}({', '.join([model] + fields)})"


def ledger_stats(ledger: dict | None) -> dict:
    """``sample_stats`` entries of a :attr:`RunResult.ledger`: ``ledger.<call>.<count>`` (or
    ``ledger.<count>`` over all calls), each ``(M,)`` with dim ``client``."""
    return {"ledger." + key.replace("/", "."): (np.asarray(value), ["client"]) for key, value in (ledger or {}).items()}


def _attr(value):
    """An attribute ArviZ can store (netCDF: numbers, strings, lists of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if value is not None else "None"
    if isinstance(value, (list, tuple, np.ndarray)):
        return np.asarray(value).tolist()
    return repr(value)


@register_converter(RunResult)
def _run_result_to_inference_data(result: RunResult, **options):
    """``nf.to_inference_data(result, num_samples=..., rng_key=...)`` for every variational
    method: the method's :meth:`~VariationalMethod.arviz_dicts`, built by ``from_dicts``."""
    from numpyro_fed.arviz import from_dicts

    method = result.method
    if not hasattr(method, "arviz_dicts"):
        raise TypeError(f"to_inference_data: result.method ({type(method).__name__}) has no arviz_dicts")
    builder = {k: options.pop(k) for k in ("dims",) if k in options}
    dicts = method.arviz_dicts(result, **options)
    dicts.update(builder)
    return from_dicts(**dicts)
