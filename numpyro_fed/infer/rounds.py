"""The round driver every variational method shares: :func:`run_rounds` (keys per round, the
progress bar, per-round metrics, the divergence check, a client's fault turned into a
resumable :class:`RunCheckpoint`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

import jax
import jax.numpy as jnp

from numpyro_fed._checks import check_int

__all__ = ["RunCheckpoint", "run_rounds"]


def _all_finite(tree) -> bool:
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)


class RunCheckpoint(NamedTuple):
    """Where an interrupted run stopped: attached as ``error.state`` to the
    :class:`~numpyro_fed.federation.ClientError` that stopped it (with ``error.result``, a
    :class:`RunResult` of the rounds done), and to the ``FloatingPointError`` of a run that
    diverged (the rounds before the non-finite one). ``method.run(rng_key, num_rounds, *args,
    init_state=checkpoint)`` with the run's key and ``num_rounds`` runs the remaining rounds
    and returns what the uninterrupted run would have (the same keys, the same state; the
    metrics of both parts).

    :ivar state: the state after the last completed round.
    :ivar int rounds_done: the rounds completed.
    :ivar int num_rounds: the rounds the run was asked for.
    :ivar dict metrics: the completed rounds' metrics (as :func:`run_rounds` returns them).
    :ivar dict context: what the method needs to finish the run as if uninterrupted (e.g.
        the state it started from, the ledger so far).
    """

    state: Any
    rounds_done: int
    num_rounds: int
    metrics: dict
    context: dict


def _stack(records: dict, wall_time: list) -> dict:
    metrics = {name: np.stack([np.asarray(v) for v in values]) for name, values in records.items()}
    metrics["wall_time"] = np.asarray(wall_time)
    return metrics


def run_rounds(
    update: Callable,
    rng_key,
    state,
    num_rounds: int,
    *,
    record: Callable | None = None,
    is_finite: Callable | None = None,
    progress_bar: bool = True,
    desc: str = "",
    divergence_advice: str = "",
    resume: RunCheckpoint | None = None,
    guard: Callable | None = None,
    context: dict | None = None,
):
    """Runs ``num_rounds`` rounds of ``update(rng_key, state) -> (state, info)``, one key
    per round (``jax.random.split(rng_key, num_rounds)``).

    After each round ``record(state, info) -> dict`` (default: ``info._asdict()`` of a
    NamedTuple ``info``, without ``None`` fields) gives that round's metrics, and
    ``is_finite(state)`` (default: every floating leaf of ``state`` finite) the divergence
    check: a ``FloatingPointError`` naming the round and ``divergence_advice``, whose
    ``error.state`` is a :class:`RunCheckpoint` of the rounds completed before it. A scalar
    ``loss`` metric is shown on the progress bar.

    **Faults.** A :class:`~numpyro_fed.federation.ClientError` raised by a round (a client
    died or stopped answering; ``guard()``, e.g. the federation's
    :meth:`~numpyro_fed.federation.Federation.guard`, is entered around each round so that
    it surfaces as itself) stops the run: the error gets ``error.state``, a
    :class:`RunCheckpoint` of the rounds completed before it (with ``context``), and is
    re-raised. ``resume=checkpoint`` (with the same ``rng_key`` and ``num_rounds``) runs the
    remaining rounds from it, with the same keys, and returns the metrics of every round.

    :return: ``(state, metrics)``: metrics by name, each a numpy array with a leading axis
        of ``num_rounds``, plus ``wall_time`` (seconds since the start, after each round).

    >>> import jax, jax.numpy as jnp
    >>> def update(key, x):  # a toy round: halve and report
    ...     return x / 2, {"loss": x}
    >>> state, metrics = run_rounds(update, jax.random.PRNGKey(0), jnp.float32(8.0), 3,
    ...                             record=lambda s, info: info, progress_bar=False)
    >>> float(state), metrics["loss"].tolist()
    (1.0, [8.0, 4.0, 2.0])
    """
    from numpyro_fed.federation import ClientError

    num_rounds = check_int(num_rounds, "num_rounds", minimum=0)
    if record is None:

        def record(state, info):
            if info is None:
                return {}
            items = info._asdict() if hasattr(info, "_asdict") else dict(info)
            return {k: v for k, v in items.items() if v is not None}

    is_finite = _all_finite if is_finite is None else is_finite
    guard = contextlib.nullcontext if guard is None else guard
    keys = jax.random.split(rng_key, num_rounds) if num_rounds else []
    records: dict[str, list] = {}
    wall_time = []
    first, offset = 0, 0.0
    if resume is not None:
        if resume.num_rounds != num_rounds:
            raise ValueError(
                f"the checkpoint is of a run of {resume.num_rounds} rounds: resume it with "
                f"num_rounds={resume.num_rounds} (and the run's rng_key), not {num_rounds}"
            )
        first = resume.rounds_done
        records = {name: list(values) for name, values in resume.metrics.items() if name != "wall_time"}
        wall_time = list(resume.metrics.get("wall_time", []))
        offset = wall_time[-1] if wall_time else 0.0
    start = time.perf_counter()
    bar = tqdm(
        range(first, num_rounds), desc=desc, unit="round", disable=not progress_bar, initial=first, total=num_rounds
    )
    try:
        for r in bar:
            try:
                with guard():
                    new_state, info = update(keys[r], state)
                    finite = is_finite(new_state)  # also waits for the round
            except ClientError as error:
                error.state = RunCheckpoint(state, r, num_rounds, _stack(records, wall_time), dict(context or {}))
                raise
            if not finite:
                error = FloatingPointError(
                    f"{desc or 'the run'} diverged: non-finite state after round {r + 1} of "
                    f"{num_rounds}" + (f"; {divergence_advice}" if divergence_advice else "")
                )
                error.state = RunCheckpoint(state, r, num_rounds, _stack(records, wall_time), dict(context or {}))
                raise error
            state = new_state
            wall_time.append(offset + time.perf_counter() - start)
            values = record(state, info)
            for name, value in values.items():
                records.setdefault(name, []).append(value)
            if progress_bar and "loss" in values and np.ndim(values["loss"]) == 0:
                bar.set_postfix(loss=f"{float(values['loss']):.4g}")
    finally:
        bar.close()
    return state, _stack(records, wall_time)
