"""DSVGD at default settings on regressions as a statistician writes them, against NumPyro NUTS
on the pooled data.

Models (400 rows, 4 clients, even split): a linear regression with raw covariates (scales 1,
10 and 100, not centred: the intercept, at 9.5, has a posterior sd of about 0.04) and
``sigma ~ HalfCauchy``; the same with flat priors (``ImproperUniform``) on every latent; a
logistic regression with flat priors and a covariate in units of 1000 (coefficient sd about
0.001); a regression with 26 correlated covariates; a Student-t regression with
``sigma ~ LogNormal``; a hierarchical model whose group effects are global latents (groups
cut across clients); a two-component normal mixture with ordered means.

Per model and dtype the script prints, over every constrained coordinate, the largest
``|mean - mean_NUTS| / sd_NUTS`` and the range of ``sd / sd_NUTS``, whether DSVGD warned, and
whether the cell agrees (every mean within 0.3 reference sd, every sd ratio in [1/1.5, 1.5]).
NUTS references (2 chains x 2000 draws, float64) are cached in ``--cache``.

    python benchmarks/dsvgd_regressions.py --dtype float64
    python benchmarks/dsvgd_regressions.py --dtype float32 --models lin_flat,student_t
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np

DTYPE = "float32"
if "--dtype" in sys.argv:
    DTYPE = sys.argv[sys.argv.index("--dtype") + 1]
if DTYPE == "float64":
    import numpyro

    numpyro.enable_x64()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.distributions import constraints  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402

import numpyro_fed as nf  # noqa: E402

NUM_ROWS, NUM_CLIENTS = 400, 4


def flat(shape=()):
    return dist.ImproperUniform(constraints.real, (), shape)


def lin_halfcauchy(X, y=None):
    b = numpyro.sample("b", dist.Normal(0, 100))
    w = numpyro.sample("w", dist.Normal(0, 10).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(5.0))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Normal(b + X @ w, sigma), obs=y)


def lin_flat(X, y=None):
    b = numpyro.sample("b", flat())
    w = numpyro.sample("w", flat((X.shape[1],)))
    sigma = numpyro.sample("sigma", dist.ImproperUniform(constraints.positive, (), ()))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Normal(b + X @ w, sigma), obs=y)


def logistic_flat(X, y=None):
    b = numpyro.sample("b", flat())
    w = numpyro.sample("w", flat((X.shape[1],)))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Bernoulli(logits=b + X @ w), obs=y)


def correlated26(X, y=None):
    b = numpyro.sample("b", dist.Normal(0, 10))
    w = numpyro.sample("w", dist.Normal(0, 10).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Normal(b + X @ w, sigma), obs=y)


def student_t(X, y=None):
    b = numpyro.sample("b", dist.Normal(0, 10))
    w = numpyro.sample("w", dist.Normal(0, 10).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.StudentT(4.0, b + X @ w, sigma), obs=y)


def hierarchical_global(X, group, y=None, num_groups=6):
    mu = numpyro.sample("mu", dist.Normal(0, 10))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    with numpyro.plate("groups", num_groups):
        eta = numpyro.sample("eta", dist.Normal(0, 1))
    w = numpyro.sample("w", dist.Normal(0, 10).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
    alpha = mu + tau * eta
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Normal(alpha[group] + X @ w, sigma), obs=y)


def mixture2(y):
    weight = numpyro.sample("weight", dist.Beta(2.0, 2.0))
    locs = numpyro.sample(
        "locs",
        dist.TransformedDistribution(
            dist.Normal(0.0, 10.0).expand([2]).to_event(1), dist.transforms.OrderedTransform()
        ),
    )
    scale = numpyro.sample("scale", dist.HalfCauchy(2.5))
    mix = dist.MixtureSameFamily(dist.Categorical(probs=jnp.stack([weight, 1 - weight])), dist.Normal(locs, scale))
    with nf.federated_plate("data", y.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", mix, obs=y)


def make_data(name, dtype):
    """The model and its arguments (numpy, cast to ``dtype``)."""
    rng = np.random.default_rng(24)
    n = NUM_ROWS
    if name in ("lin_halfcauchy", "lin_flat", "student_t"):
        X = np.stack([rng.normal(5, 1, n), rng.normal(50, 10, n), rng.normal(300, 100, n)], axis=1)
        noise = rng.standard_t(4, n) * 0.8 if name == "student_t" else rng.normal(0, 0.8, n)
        y = 9.5 + X @ np.array([0.5, -0.03, 0.004]) + noise
        args = (X, y)
    elif name == "logistic_flat":
        X = np.stack([rng.normal(0, 1, n), rng.normal(40, 12, n), rng.normal(2000, 1000, n)], axis=1)
        logits = -1.0 + 0.8 * X[:, 0] + 0.02 * (X[:, 1] - 40) + 0.0008 * (X[:, 2] - 2000)
        args = (X, (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(float))
    elif name == "correlated26":
        factor = rng.normal(0, 1, (n, 1))
        X = 0.8 * factor + 0.6 * rng.normal(0, 1, (n, 26))
        X = X * np.linspace(1, 20, 26)
        y = 2.0 + X @ (rng.normal(0, 1, 26) / np.linspace(1, 20, 26)) + rng.normal(0, 1.0, n)
        args = (X, y)
    elif name == "hierarchical_global":
        group = rng.integers(0, 6, n)
        X = rng.normal(0, 1, (n, 2)) * np.array([1.0, 10.0])
        alpha = 3.0 + 0.7 * rng.normal(0, 1, 6)
        y = alpha[group] + X @ np.array([0.5, -0.1]) + rng.normal(0, 1.0, n)
        return hierarchical_global, (X.astype(dtype), group, y.astype(dtype))
    elif name == "mixture2":
        comp = rng.random(n) < 0.35
        args = (np.where(comp, -1.5, 2.0) + 0.8 * rng.normal(0, 1, n),)
    else:
        raise KeyError(name)
    return MODELS[name], tuple(a.astype(dtype) for a in args)


MODELS = {
    "lin_halfcauchy": lin_halfcauchy,
    "lin_flat": lin_flat,
    "logistic_flat": logistic_flat,
    "correlated26": correlated26,
    "student_t": student_t,
    "hierarchical_global": hierarchical_global,
    "mixture2": mixture2,
}


def flat_draws(draws):
    return np.concatenate([np.asarray(v, float).reshape(np.shape(v)[0], -1) for _, v in sorted(draws.items())], 1)


def reference(name, cache):
    path = os.path.join(cache, f"nuts_{name}.npy")
    if os.path.exists(path):
        return np.load(path)
    if DTYPE != "float64":
        raise SystemExit(f"no NUTS reference for {name}: run with --dtype float64 first")
    model, args = make_data(name, "float64")
    mcmc = MCMC(NUTS(model), num_warmup=1000, num_samples=2000, num_chains=2, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *args)
    draws = {k: v for k, v in mcmc.get_samples().items()}
    out = flat_draws(draws)
    os.makedirs(cache, exist_ok=True)
    np.save(path, out)
    return out


def measure(name, cache, num_rounds, options):
    ref = reference(name, cache)
    model, args = make_data(name, DTYPE)
    method = nf.DSVGD(model, progress_bar=False, **options)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = method.run(jax.random.PRNGKey(1), num_rounds, *args)
            draws = flat_draws(method.get_samples(jax.random.PRNGKey(2), result))
            error = None
        except Exception as e:  # a refusal is a cell result
            draws, error = None, f"{type(e).__name__}: {str(e)[:90]}"
    seconds = time.perf_counter() - start
    warned = [str(w.message)[:100] for w in caught if issubclass(w.category, RuntimeWarning)]
    if draws is None:
        return dict(model=name, error=error, seconds=seconds)
    m_ref, s_ref = ref.mean(0), ref.std(0)
    offsets = np.abs(draws.mean(0) - m_ref) / s_ref
    ratios = draws.std(0) / s_ref
    agree = bool(np.all(offsets < 0.3) and np.all((ratios > 1 / 1.5) & (ratios < 1.5)))
    stein_mean, stein_scale = result.metrics["stein_mean"][-1], result.metrics["stein_scale"][-1]
    return dict(
        model=name,
        max_offset=float(np.nanmax(offsets)),
        ratio_min=float(np.nanmin(ratios)),
        ratio_max=float(np.nanmax(ratios)),
        agree=agree,
        warned=warned,
        seconds=seconds,
        stein=f"{np.max(np.abs(stein_mean) / np.sqrt(np.maximum(stein_scale, 1e-12))):.2f} / "
        f"{np.min(stein_scale):.2f}-{np.max(stein_scale):.2f}",
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--cache", default=os.path.join(os.path.dirname(__file__), "results", "nuts_regressions"))
    parser.add_argument("--option", action="append", default=[], help="DSVGD option name=value (Python literal)")
    a = parser.parse_args()
    import ast

    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in a.option)}
    print(f"DSVGD {options or 'defaults'}, {a.rounds} rounds, {DTYPE}")
    print(
        "| model | max mean error (ref sd) | sd ratios | agrees | warned | Stein offset / scale | s |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name in a.models.split(","):
        r = measure(name, a.cache, a.rounds, options)
        if "error" in r:
            print(f"| {name} | {r['error']} | | no | | | {r['seconds']:.0f} |", flush=True)
            continue
        w = "yes: " + r["warned"][0][:60] if r["warned"] else "no"
        print(
            f"| {name} | {r['max_offset']:.2f} | {r['ratio_min']:.2f}-{r['ratio_max']:.2f} | "
            f"{'yes' if r['agree'] else 'NO'} | {w} | {r['stein']} | {r['seconds']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
