"""DP-PVI on UCI Adult (Heikkilä et al. 2023, Section 5, Figures 1 and 3).

Bayesian logistic regression (standard normal prior, bias column) on Adult split over
clients by the paper's scheme (``partition.by_label`` with ``DPPVI_SPLITS``). For every
variant: test accuracy and test log-likelihood of the Monte Carlo predictive (100 draws of
q) after each round, against the number of server-client communications; the (epsilon,
delta) the run reports; wall time.

    python benchmarks/dppvi.py --split balanced --epsilon 1 --seeds 0,1,2,3,4
    python benchmarks/dppvi.py --variants dpsgd,virtual --num-clients 200 --epsilon 0.5
    python benchmarks/dppvi.py --model bnn --epsilon 2 --variants pvi,dpsgd,bcm_same,global_vi
    python benchmarks/dppvi.py --defaults --seeds 0,1,2   # default settings vs exact / NUTS

With several ``--seeds`` (each also redraws the split) it prints the mean and standard error
of the final figures per variant. With more shards than the smallest client has rows (200
clients), the update-perturbation variants use one shard per row of the smallest client.

Writes ``benchmarks/results/dppvi_<model>_<split>_<M>clients_eps<epsilon>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np

import jax
import jax.numpy as jnp
import optax

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed import metrics, partition
from numpyro_fed.datasets import load_adult
from numpyro_fed.infer.pvi import BCM, DPPVI, GlobalVI, dp_defaults

ADULT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "shared", "data", "uci_adult")

# Hyper-parameters per variant (tuned by hand on the balanced 10-client split at epsilon = 1,
# seed 0; the sweep of the update-perturbation variants is in benchmarks/dppvi.md); "rounds"
# are global rounds, each visiting every client once.
VARIANTS = {
    "pvi (non-private)": dict(
        cls=DPPVI,
        rounds=4,
        kwargs=dict(
            dp=None, optim=optax.adam(2e-2), num_local_steps=200, sampling="poisson", sampling_rate=0.05, damping=0.5
        ),
    ),
    "dpsgd": dict(
        cls=DPPVI,
        rounds=2,
        kwargs=dict(
            dp="dpsgd",
            optim=optax.adam(2e-2),
            num_local_steps=200,
            sampling="poisson",
            sampling_rate=0.05,
            clip_norm=2.0,
            damping=0.5,
        ),
    ),
    # given only the budget: the automatic rate, clip norm and damping (a refusal is printed)
    "dpsgd, budget only": dict(cls=DPPVI, rounds=2, kwargs=dict(dp="dpsgd")),
    "local avg": dict(
        cls=DPPVI,
        rounds=2,
        kwargs=dict(
            dp="local_avg",
            optim=optax.adam(1e-1),
            num_local_steps=40,
            num_mc_samples=4,
            num_shards=500,
            clip_norm=50.0,
            damping=0.2,
        ),
    ),
    "virtual": dict(
        cls=DPPVI,
        rounds=2,
        kwargs=dict(
            dp="virtual",
            optim=optax.adam(5e-2),
            num_local_steps=100,
            num_mc_samples=4,
            num_shards=1000,
            clip_norm=0.5,
            damping=0.2,
        ),
    ),
    "local avg, trusted aggr.": dict(
        cls=DPPVI,
        rounds=2,
        kwargs=dict(
            dp="local_avg",
            optim=optax.adam(1e-1),
            num_local_steps=40,
            num_mc_samples=4,
            num_shards=500,
            clip_norm=50.0,
            damping=0.3,
            schedule="synchronous",
            trusted_aggregator=True,
        ),
    ),
    "virtual, trusted aggr.": dict(
        cls=DPPVI,
        rounds=2,
        kwargs=dict(
            dp="virtual",
            optim=optax.adam(5e-2),
            num_local_steps=100,
            num_mc_samples=4,
            num_shards=1000,
            clip_norm=0.5,
            damping=0.3,
            schedule="synchronous",
            trusted_aggregator=True,
        ),
    ),
    "bcm same": dict(
        cls=BCM,
        rounds=1,
        kwargs=dict(
            prior="same",
            optim=optax.adam(2e-2),
            num_local_steps=400,
            sampling="poisson",
            sampling_rate=0.05,
            clip_norm=2.0,
        ),
    ),
    "bcm split": dict(
        cls=BCM,
        rounds=1,
        kwargs=dict(
            prior="split",
            optim=optax.adam(2e-2),
            num_local_steps=400,
            sampling="poisson",
            sampling_rate=0.05,
            clip_norm=2.0,
        ),
    ),
    "global vi, trusted aggr.": dict(
        cls=GlobalVI,
        rounds=1,
        kwargs=dict(
            optim=optax.adam(2e-2), num_local_steps=1000, sampling="poisson", sampling_rate=0.01, clip_norm=2.0
        ),
    ),
    "global vi (non-private)": dict(
        cls=GlobalVI,
        rounds=1,
        kwargs=dict(dp=None, optim=optax.adam(2e-2), num_local_steps=1000, sampling="poisson", sampling_rate=0.01),
    ),
}
# The BNN of Figure 4 (epsilon = 2). The update-perturbation variants use fewer shards than
# for logistic regression: every shard holds a copy of the 5,501 weights' optimiser state.
_BNN_UPDATE = dict(optim=optax.adam(1e-2), num_local_steps=100, num_mc_samples=2)
BNN_VARIANTS = {
    "pvi (non-private)": dict(
        cls=DPPVI,
        rounds=4,
        kwargs=dict(
            dp=None,
            optim=optax.adam(1e-2),
            num_local_steps=200,
            num_mc_samples=2,
            sampling="poisson",
            sampling_rate=0.05,
            damping=0.5,
        ),
    ),
    "dpsgd": dict(
        cls=DPPVI,
        rounds=2,
        kwargs=dict(
            dp="dpsgd",
            optim=optax.adam(1e-2),
            num_local_steps=200,
            num_mc_samples=2,
            sampling="poisson",
            sampling_rate=0.05,
            clip_norm=2.0,
            damping=0.5,
        ),
    ),
    "local avg": dict(
        cls=DPPVI, rounds=2, kwargs=dict(dp="local_avg", num_shards=20, clip_norm=50.0, damping=0.2, **_BNN_UPDATE)
    ),
    "virtual": dict(
        cls=DPPVI, rounds=2, kwargs=dict(dp="virtual", num_shards=50, clip_norm=1.0, damping=0.2, **_BNN_UPDATE)
    ),
    "local avg, trusted aggr.": dict(
        cls=DPPVI,
        rounds=2,
        kwargs=dict(
            dp="local_avg",
            num_shards=20,
            clip_norm=50.0,
            damping=0.3,
            schedule="synchronous",
            trusted_aggregator=True,
            **_BNN_UPDATE,
        ),
    ),
    "virtual, trusted aggr.": dict(
        cls=DPPVI,
        rounds=2,
        kwargs=dict(
            dp="virtual",
            num_shards=50,
            clip_norm=1.0,
            damping=0.3,
            schedule="synchronous",
            trusted_aggregator=True,
            **_BNN_UPDATE,
        ),
    ),
    "bcm same": dict(
        cls=BCM,
        rounds=1,
        kwargs=dict(
            prior="same",
            optim=optax.adam(1e-2),
            num_local_steps=400,
            num_mc_samples=2,
            sampling="poisson",
            sampling_rate=0.05,
            clip_norm=2.0,
        ),
    ),
    "bcm split": dict(
        cls=BCM,
        rounds=1,
        kwargs=dict(
            prior="split",
            optim=optax.adam(1e-2),
            num_local_steps=400,
            num_mc_samples=2,
            sampling="poisson",
            sampling_rate=0.05,
            clip_norm=2.0,
        ),
    ),
    "global vi, trusted aggr.": dict(
        cls=GlobalVI,
        rounds=1,
        kwargs=dict(
            optim=optax.adam(1e-2),
            num_local_steps=1000,
            num_mc_samples=2,
            sampling="poisson",
            sampling_rate=0.01,
            clip_norm=2.0,
        ),
    ),
}

SHORT = {
    "pvi": "pvi (non-private)",
    "dpsgd": "dpsgd",
    "dpsgd_budget": "dpsgd, budget only",
    "local_avg": "local avg",
    "virtual": "virtual",
    "local_avg_trusted": "local avg, trusted aggr.",
    "virtual_trusted": "virtual, trusted aggr.",
    "bcm_same": "bcm same",
    "bcm_split": "bcm split",
    "global_vi": "global vi, trusted aggr.",
    "global_vi_nonprivate": "global vi (non-private)",
}


def logistic_regression(X, y=None, clients=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def bnn(X, y=None, clients=None, hidden=50):
    """One hidden layer of ``hidden`` ReLUs, standard normal priors (Section 5, Figure 4)."""
    p = X.shape[1]
    w1 = numpyro.sample("w1", dist.Normal(0, 1).expand([p, hidden]).to_event(2))
    b1 = numpyro.sample("b1", dist.Normal(0, 1).expand([hidden]).to_event(1))
    w2 = numpyro.sample("w2", dist.Normal(0, 1).expand([hidden]).to_event(1))
    b2 = numpyro.sample("b2", dist.Normal(0, 1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=jax.nn.relu(X @ w1 + b1) @ w2 + b2), obs=y)


MODELS = {
    "logistic": (logistic_regression, lambda v, X: X @ v["w"]),
    "bnn": (bnn, lambda v, X: jax.nn.relu(X @ v["w1"] + v["b1"]) @ v["w2"] + v["b2"]),
}


def with_bias(X):
    return np.concatenate([np.ones((X.shape[0], 1)), X], axis=1)


def evaluate(loc, scale, unravel, logits_fn, X_test, y_test, rng_key, num_draws=100):
    """Accuracy and mean test log-likelihood of the Monte Carlo predictive."""
    flat = loc + scale * jax.random.normal(rng_key, (num_draws, loc.shape[0]), loc.dtype)
    logits = jax.vmap(lambda f: logits_fn(unravel(f), jnp.asarray(X_test)))(flat).T  # (n, S)
    log_lik = jnp.where(jnp.asarray(y_test)[:, None] == 1, jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits))
    probs = np.asarray(jnp.mean(jax.nn.sigmoid(logits), axis=1))
    return metrics.accuracy(probs, y_test), metrics.log_predictive_density(np.asarray(log_lik.T))


def forced_rate(kwargs, sizes, rounds):
    """The budget-only rule's sampling rate for these sizes (given explicitly, the run warns
    instead of refusing)."""
    probe = DPPVI(lambda: None, **kwargs)
    steps = rounds * probe.num_local_steps
    return dp_defaults.auto_sampling_rate(int(np.min(sizes)), probe.single_noise_multiplier(), steps)


def run_variant(name, spec, X, y, owner, X_test, y_test, epsilon, delta, seed, num_clients, model="logistic"):
    kwargs = dict(spec["kwargs"], progress_bar=False)
    if kwargs.get("num_shards", 1) > 1:
        # at most one shard per row of the smallest client (200 clients, unbalanced splits)
        kwargs["num_shards"] = min(kwargs["num_shards"], int(np.bincount(owner, minlength=num_clients).min()))
    if kwargs.get("dp", "dpsgd") is not None:
        kwargs.update(target_epsilon=epsilon, delta=delta)
    model_clients = owner
    model_fn, logits_fn = MODELS[model]
    method = spec["cls"](lambda X, y=None: model_fn(X, y, clients=model_clients), **kwargs)
    key = jax.random.PRNGKey(seed)
    start = time.perf_counter()
    result = method.run(key, spec["rounds"], X, y)
    jax.block_until_ready(result.state.q)
    wall = time.perf_counter() - start
    curve = []
    for r in range(result.metrics["loc"].shape[0]):
        acc, ll = evaluate(
            result.metrics["loc"][r],
            result.metrics["scale"][r],
            method.federated_potential.unravel,
            logits_fn,
            X_test,
            y_test,
            jax.random.PRNGKey(1000 + r),
        )
        curve.append(
            {"communications": int(result.metrics["communications"][r]), "accuracy": acc, "log_likelihood": ll}
        )
    return {
        "variant": name,
        "seed": seed,
        "num_shards": kwargs.get("num_shards", 1),
        "wall_seconds": wall,
        "epsilon": None if result.privacy is None else result.privacy.epsilon,
        "delta": None if result.privacy is None else result.privacy.delta,
        "noise_multiplier": float(np.max(result.metrics["noise_multiplier"])),
        "rejected_updates": int(np.sum(result.metrics["rejected"])),
        "curve": curve,
    }


def summarise(results):
    """Per variant over seeds: mean and standard error of the final accuracy and test
    log-likelihood (the paper: mean over 5 seeds with SEM), epsilon, wall time."""
    by_name = {}
    for r in results:
        by_name.setdefault(r["variant"], []).append(r)
    summary = {}
    for name, runs in by_name.items():
        acc = np.array([r["curve"][-1]["accuracy"] for r in runs])
        ll = np.array([r["curve"][-1]["log_likelihood"] for r in runs])
        sem = lambda v: float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else float("nan")
        eps = [r["epsilon"] for r in runs if r["epsilon"] is not None]
        summary[name] = {
            "seeds": [r["seed"] for r in runs],
            "communications": runs[0]["curve"][-1]["communications"],
            "accuracy_mean": float(acc.mean()),
            "accuracy_sem": sem(acc),
            "log_likelihood_mean": float(ll.mean()),
            "log_likelihood_sem": sem(ll),
            "epsilon_max": max(eps) if eps else None,
            "wall_seconds_mean": float(np.mean([r["wall_seconds"] for r in runs])),
        }
    return summary


# -- the defaults (no hand tuning) ------------------------------------------------------------------


def _regression_problem(n, d, clients, noise, coef, seed=0):
    """Linear regression with known noise and a N(0, 1) prior: exact Gaussian posterior."""
    X = jax.random.normal(jax.random.PRNGKey(seed), (n, d))
    y = X @ jnp.asarray(coef) + noise * jax.random.normal(jax.random.PRNGKey(seed + 1), (n,))

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([d]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Normal(X @ w, noise), obs=y)

    Xn, yn = np.asarray(X, float), np.asarray(y, float)
    precision = np.eye(d) + Xn.T @ Xn / noise**2
    mean = np.linalg.solve(precision, Xn.T @ yn / noise**2)
    return model, (X, y), mean, 1 / np.sqrt(np.diag(precision)), None  # mean-field VI's optimum


def heldout_lpd(draws, X_test, y_test):
    """Mean log predictive density of held-out rows under posterior draws ``(S, d)`` of a
    logistic regression's coefficients, nats/row."""
    logits = np.asarray(X_test, float) @ np.asarray(draws, float).T  # (n, S)
    log_lik = np.where(np.asarray(y_test)[:, None] == 1, -np.logaddexp(0, -logits), -np.logaddexp(0, logits))
    top = log_lik.max(axis=1)
    return float(np.mean(top + np.log(np.mean(np.exp(log_lik - top[:, None]), axis=1))))


def _logistic_draws(n, d, coef, key_x, key_y):
    X = jax.random.normal(key_x, (n, d))
    y = (jax.random.uniform(key_y, (n,)) < jax.nn.sigmoid(X @ jnp.array(coef))) * 1.0
    return X, y


def _logistic_problem(n, clients, seed=0, coef=(1.0, -1.0, 0.5), num_test=5000):
    """Logistic regression, N(0, 1) prior on the coefficients ``coef`` (default 3); reference:
    NUTS on the pooled rows; ``num_test`` held-out rows and NUTS's log predictive density on
    them."""
    from numpyro.infer import MCMC, NUTS

    d = len(coef)
    X, y = _logistic_draws(n, d, coef, jax.random.PRNGKey(seed), jax.random.PRNGKey(seed + 1))
    X_test, y_test = _logistic_draws(num_test, d, coef, jax.random.PRNGKey(seed + 2), jax.random.PRNGKey(seed + 3))

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([d]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    def pooled(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([d]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    mcmc = MCMC(NUTS(pooled), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed + 5), X, y)
    draws = np.asarray(mcmc.get_samples()["w"])
    return model, (X, y), draws.mean(0), draws.std(0), (X_test, y_test, heldout_lpd(draws, X_test, y_test))


_COEF5 = (1.0, -1.0, 0.5, 0.25, -0.5)

DEFAULT_PROBLEMS = {
    # name: (problem, DPPVI kwargs, rounds)
    "regression, non-private": (lambda: _regression_problem(400, 3, 4, 1.0, [1.0, -2.0, 0.5]), {}, 5),
    "regression, non-private, former default": (
        lambda: _regression_problem(400, 3, 4, 1.0, [1.0, -2.0, 0.5]),
        dict(optim=optax.adam(1e-2)),
        5,
    ),
    "logistic 4x250, eps 1": (lambda: _logistic_problem(1000, 4), dict(dp="dpsgd", target_epsilon=1.0), 2),
    "logistic 4x250, eps 1, former default": (
        lambda: _logistic_problem(1000, 4),
        dict(dp="dpsgd", target_epsilon=1.0, sampling="full", clip_norm=1.0, optim=optax.adam(1e-2)),
        2,
    ),
    "logistic 4x5000, eps 4": (lambda: _logistic_problem(20000, 4), dict(dp="dpsgd", target_epsilon=4.0), 2),
    # the budget-only row next to the hand-tuned one (Adult's settings) on 5 x 4,000 rows, 5 coefficients
    "logistic 5x4000 d5, eps 1, budget only": (
        lambda: _logistic_problem(20000, 5, coef=_COEF5),
        dict(dp="dpsgd", target_epsilon=1.0),
        2,
    ),
    "logistic 5x4000 d5, eps 1, hand-tuned": (
        lambda: _logistic_problem(20000, 5, coef=_COEF5),
        dict(VARIANTS["dpsgd"]["kwargs"], target_epsilon=1.0),
        2,
    ),
    "regression 2x40000, eps 4": (
        lambda: _regression_problem(80000, 2, 2, 1.0, [0.5, -1.0]),
        dict(dp="dpsgd", target_epsilon=4.0),
        2,
    ),
}


def run_defaults(seeds, names=None):
    """Every problem of DEFAULT_PROBLEMS with default settings (and the former defaults):
    the largest error of the means and the range of the sd ratios against the reference,
    in posterior sds; the automatic settings; refusals and warnings."""
    import warnings

    rows = []
    for name, (make, kwargs, rounds) in DEFAULT_PROBLEMS.items():
        if names and name not in names:
            continue
        model, data, mean, sd, heldout = make()
        for seed in seeds:
            method = DPPVI(model, progress_bar=False, **kwargs)
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    result = method.run(jax.random.PRNGKey(seed), rounds, *data)
                except ValueError as error:
                    print(f"{name:42s} seed {seed}  refused: {error}", flush=True)
                    rows.append({"problem": name, "seed": seed, "refused": str(error)})
                    continue
            params = method.get_params(result.state)
            loc, scale = np.asarray(params["loc"]["w"]), np.asarray(params["scale"]["w"])
            row = {
                "problem": name,
                "seed": seed,
                "max_abs_error_sd": float(np.max(np.abs(loc - mean) / sd)),
                "sd_ratio_min": float(np.min(scale / sd)),
                "sd_ratio_max": float(np.max(scale / sd)),
                "epsilon": None if result.privacy is None else result.privacy.epsilon,
                "noise_multiplier": float(np.max(result.metrics["noise_multiplier"])),
                "sampling_rate": method.sampling_rate,
                "predicted_dp_error": float(result.metrics["predicted_dp_error"][-1]),
                "lpd_gap": None,
                "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                "wall_seconds": time.perf_counter() - start,
            }
            if heldout is not None:  # NUTS's held-out log predictive density minus q's, nats/row
                draws = loc + scale * np.random.default_rng(seed).normal(size=(2000, loc.size))
                row["lpd_gap"] = heldout[2] - heldout_lpd(draws, *heldout[:2])
            rows.append(row)
            gap = "" if row["lpd_gap"] is None else f"  lpd gap {row['lpd_gap']:.5f}"
            print(
                f"{name:42s} seed {seed}  max |error| {row['max_abs_error_sd']:.3f} sd{gap}  sd ratio "
                f"{row['sd_ratio_min']:.2f}-{row['sd_ratio_max']:.2f}  rate {row['sampling_rate']:.4g}  "
                f"sigma {row['noise_multiplier']:.3g}  predicted {row['predicted_dp_error']:.2g}  "
                f"warnings {len(row['warnings'])}  {row['wall_seconds']:.1f} s",
                flush=True,
            )
    return rows


# -- the grid the budget-only rule's prediction was fitted on ------------------------------------

#: (rows per client, coefficients, epsilon); 5 clients, 2 rounds, delta 1e-5
GRID = [(4000, 5, 1.0), (4000, 5, 4.0), (1000, 5, 4.0), (16000, 5, 1.0), (4000, 2, 1.0), (4000, 10, 2.0)]
GRID += [(16000, 10, 4.0), (1000, 2, 4.0)]
# added with the refusal threshold (REFUSE_DP_ERROR) and the largest checked dimension (FIT_MAX_DIM)
GRID += [(250, 5, 1.0), (1000, 5, 1.0), (4000, 20, 4.0)]
GRID_CLIENTS, GRID_TEST = 5, 5000


def _grid_problem(rows, d):
    """5 clients of ``rows`` rows plus ``GRID_TEST`` held-out rows (one draw, split), the
    coefficients ``_COEF5`` cut or repeated to ``d``; NUTS on the pooled training rows."""
    from numpyro.infer import MCMC, NUTS

    n = rows * GRID_CLIENTS
    X, y = _logistic_draws(n + GRID_TEST, d, np.resize(_COEF5, d), jax.random.PRNGKey(0), jax.random.PRNGKey(1))

    def pooled(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([d]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    mcmc = MCMC(NUTS(pooled), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(5), X[:n], y[:n])
    draws = np.asarray(mcmc.get_samples()["w"])
    return (X[:n], y[:n]), (X[n:], y[n:]), draws


def run_grid(seeds, damping=None):
    """The budget-only rule's settings on every cell of ``GRID``, run anyway (the rule's rate
    given explicitly: a prediction above 1 warns instead of refusing): the largest error of
    q's means in NUTS sds against ``predicted_dp_error``, the sd ratios, the held-out log
    predictive density below NUTS's."""
    import warnings

    rows_out = []
    for rows, d, epsilon in GRID:
        data, test, draws = _grid_problem(rows, d)
        mean, sd = draws.mean(0), draws.std(0)

        def model(X, y=None):
            w = numpyro.sample("w", dist.Normal(0, 1).expand([d]).to_event(1))
            with nf.federated_plate("data", X.shape[0], clients=GRID_CLIENTS):
                numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

        for seed in seeds:
            kw = dict(dp="dpsgd", target_epsilon=epsilon, delta=1e-5, progress_bar=False)
            kw.update(sampling="poisson", sampling_rate=forced_rate(kw, np.full(GRID_CLIENTS, rows), 2))
            kw["damping"] = dp_defaults.default_damping(True) if damping is None else damping
            method = DPPVI(model, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                result = method.run(jax.random.PRNGKey(seed), 2, *data)
            params = method.get_params(result.state)
            loc, scale = np.asarray(params["loc"]["w"]), np.asarray(params["scale"]["w"])
            q_draws = loc + scale * np.random.default_rng(0).normal(size=(2000, d))
            row = {
                "rows": rows,
                "d": d,
                "epsilon": epsilon,
                "seed": seed,
                "damping": kw["damping"],
                "predicted": float(result.metrics["predicted_dp_error"][-1]),
                "max_abs_error_sd": float(np.max(np.abs(loc - mean) / sd)),
                "sd_ratio": [float(np.min(scale / sd)), float(np.max(scale / sd))],
                "lpd_gap": heldout_lpd(draws, *test) - heldout_lpd(q_draws, *test),
                "sampling_rate": method.sampling_rate,
                "noise_multiplier": float(np.max(result.metrics["noise_multiplier"])),
            }
            rows_out.append(row)
            print(
                f"{rows:6d} rows x {GRID_CLIENTS}, d {d:2d}, eps {epsilon:g}, seed {seed}: predicted "
                f"{row['predicted']:.2f}  measured {row['max_abs_error_sd']:.2f}  sd ratio "
                f"{row['sd_ratio'][0]:.2f}-{row['sd_ratio'][1]:.2f}  lpd gap {row['lpd_gap']:.5f}",
                flush=True,
            )
    return rows_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="balanced", choices=sorted(partition.DPPVI_SPLITS))
    parser.add_argument("--num-clients", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seeds", default="0", help="comma-separated; each seed also redraws the split")
    parser.add_argument("--variants", default=",".join(SHORT))
    parser.add_argument("--model", default="logistic", choices=sorted(MODELS))
    parser.add_argument("--data", default=ADULT)
    parser.add_argument(
        "--drop-rare",
        type=int,
        default=0,
        metavar="N",
        help="drop one-hot columns with fewer than N training rows (a diagnostic: "
        "the update-perturbation variants' noise swamps rare coordinates)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="instead of Adult: DPPVI with default settings on problems with exact or NUTS "
        "references (non-private convergence; DP-SGD given only a budget)",
    )
    parser.add_argument(
        "--grid",
        action="store_true",
        help="instead of Adult: the grid of logistic regressions the budget-only DP-SGD rule's "
        "predicted error was fitted on (the rule's settings run anyway, against NUTS)",
    )
    parser.add_argument("--damping", type=float, default=None, help="--grid: this damping instead of the rule's")
    parser.add_argument("--only", default=None, help="--defaults: only the problems whose name contains this")
    args = parser.parse_args(argv)
    if args.grid:
        rows = run_grid([int(s) for s in args.seeds.split(",")], damping=args.damping)
        out_path = args.out or os.path.join(os.path.dirname(__file__), "results", "dppvi_grid.json")
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        with open(out_path, "w") as handle:
            json.dump({"seeds": args.seeds, "load_average": os.getloadavg(), "results": rows}, handle, indent=1)
        print(f"wrote {out_path}")
        return
    if args.defaults:
        names = [n for n in DEFAULT_PROBLEMS if args.only in n] if args.only else None
        rows = run_defaults([int(s) for s in args.seeds.split(",")], names)
        out_path = args.out or os.path.join(os.path.dirname(__file__), "results", "dppvi_defaults.json")
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        with open(out_path, "w") as handle:
            json.dump({"seeds": args.seeds, "load_average": os.getloadavg(), "results": rows}, handle, indent=1)
        print(f"wrote {out_path}")
        return

    data = load_adult(args.data, seed=0)
    if args.drop_rare:
        binary = np.all(np.isin(data.X_train, (0.0, 1.0)), axis=0)
        keep = ~binary | ((data.X_train != 0).sum(0) >= args.drop_rare)
        names = tuple(n for n, k in zip(data.feature_names, keep) if k)
        data = dataclasses.replace(
            data, X_train=data.X_train[:, keep], X_test=data.X_test[:, keep], feature_names=names
        )
        print(f"kept {keep.sum()} of {keep.size} columns", flush=True)
    if args.model == "logistic":
        X, X_test = with_bias(data.X_train), with_bias(data.X_test)
    else:
        X, X_test = data.X_train, data.X_test
    table = VARIANTS if args.model == "logistic" else BNN_VARIANTS
    rho, kappa = partition.DPPVI_SPLITS[args.split]
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        owner = partition.by_label(data.y_train, args.num_clients, rho=rho, kappa=kappa, seed=seed)
        for short in args.variants.split(","):
            name = SHORT[short]
            if name not in table:
                continue
            try:
                out = run_variant(
                    name,
                    table[name],
                    X,
                    data.y_train,
                    owner,
                    X_test,
                    data.y_test,
                    args.epsilon,
                    args.delta,
                    seed,
                    args.num_clients,
                    args.model,
                )
            except ValueError as error:  # a budget-only run the defaults refuse
                print(f"{name:26s} seed {seed}  refused: {error}", flush=True)
                continue
            results.append(out)
            last = out["curve"][-1]
            best = max(out["curve"], key=lambda c: c["log_likelihood"])
            eps = "-" if out["epsilon"] is None else f"{out['epsilon']:.4f}"
            print(
                f"{name:26s} seed {seed}  eps {eps:>7s}  comms {last['communications']:6d}  "
                f"acc {last['accuracy']:.4f}  ll {last['log_likelihood']:.4f}  "
                f"(best ll {best['log_likelihood']:.4f} at {best['communications']})  "
                f"sigma {out['noise_multiplier']:.3f}  rejected {out['rejected_updates']}  "
                f"{out['wall_seconds']:.1f} s",
                flush=True,
            )
    out_path = args.out or os.path.join(
        os.path.dirname(__file__),
        "results",
        f"dppvi_{args.model}_{args.split}_{args.num_clients}clients_eps{args.epsilon:g}"
        + (f"_droprare{args.drop_rare}" if args.drop_rare else "")
        + ".json",
    )
    summary = summarise(results)
    print(f"\nmean +- SEM over seeds {args.seeds}:")
    for name, row in summary.items():
        eps = "-" if row["epsilon_max"] is None else f"{row['epsilon_max']:.3f}"
        print(
            f"{name:26s} comms {row['communications']:6d}  "
            f"acc {row['accuracy_mean']:.4f} +- {row['accuracy_sem']:.4f}  "
            f"ll {row['log_likelihood_mean']:.4f} +- {row['log_likelihood_sem']:.4f}  eps {eps:>6s}  "
            f"{row['wall_seconds_mean']:.1f} s/run"
        )
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as handle:
        json.dump(
            {
                "model": args.model,
                "split": args.split,
                "num_clients": args.num_clients,
                "epsilon": args.epsilon,
                "delta": args.delta,
                "seeds": args.seeds,
                "load_average": os.getloadavg(),
                "summary": summary,
                "results": results,
            },
            handle,
            indent=1,
        )
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
