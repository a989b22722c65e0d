"""DPPVI at its defaults on regressions a statistician would write, against NumPyro NUTS on the
pooled data.

Models: ``sigma ~ HalfCauchy`` with raw covariates (scales 1 to 100), flat priors
(``ImproperUniform``) with an intercept far from 0 and a small sd, a correlated regression with
26 coefficients, a logistic regression with flat priors and a coefficient of sd about 0.001, a
Poisson regression with an offset, a two-component normal mixture (global latents, Dirichlet
weights) and a Student-t regression; 4 clients, even split. Per model the table gives the
largest error of a posterior mean in NUTS sds and the range of the sd ratios DPPVI / NUTS over
every constrained coordinate, whether the cell agrees (error <= 0.3 and ratios in [1/1.5,
1.5]) and the warnings the run gave.

    PYTHONPATH=$PWD python benchmarks/dppvi_models.py            # float64
    PYTHONPATH=$PWD python benchmarks/dppvi_models.py --float32
    PYTHONPATH=$PWD python benchmarks/dppvi_models.py --models poisson_offset --covariance diagonal
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import numpy as np

MODELS = (
    "halfcauchy_raw",
    "flat_intercept",
    "correlated_26",
    "logistic_flat",
    "poisson_offset",
    "mixture",
    "student_t",
)
NUM_CLIENTS = 4
MAX_MEAN_ERROR = 0.3
MAX_SD_RATIO = 1.5


def build(name, seed=0):
    """``(model, args)`` of a named model with simulated data."""
    import jax.numpy as jnp

    import numpyro
    import numpyro.distributions as dist
    from numpyro.distributions import constraints

    import numpyro_fed as nf

    rng = np.random.default_rng(seed)
    flat = dist.ImproperUniform(constraints.real, (), ())
    n = 400

    if name == "halfcauchy_raw":
        X = rng.normal(size=(n, 3)) * np.array([1.0, 10.0, 100.0]) + np.array([0.0, 50.0, 300.0])
        y = 2.0 + X @ np.array([0.5, -0.2, 0.01]) + rng.normal(size=n) * 1.5

        def model(X, y=None):
            a = numpyro.sample("a", dist.Normal(0.0, 100.0))
            b = numpyro.sample("b", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
            sigma = numpyro.sample("sigma", dist.HalfCauchy(5.0))
            with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
                numpyro.sample("y", dist.Normal(a + X @ b, sigma), obs=y)

        return model, (X, y)
    if name == "flat_intercept":
        X = rng.normal(size=(n, 2)) * np.array([1.0, 20.0])
        y = 9.5 + X @ np.array([0.3, 0.05]) + rng.normal(size=n) * 0.8

        def model(X, y=None):
            a = numpyro.sample("a", flat)
            b = numpyro.sample("b", dist.ImproperUniform(constraints.real, (), (2,)))
            sigma = numpyro.sample("sigma", dist.ImproperUniform(constraints.positive, (), ()))
            with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
                numpyro.sample("y", dist.Normal(a + X @ b, sigma), obs=y)

        return model, (X, y)
    if name == "correlated_26":
        d = 26
        latent = rng.normal(size=(n, 3))
        X = latent @ rng.normal(size=(3, d)) + 0.3 * rng.normal(size=(n, d))
        X = X * rng.uniform(1.0, 10.0, size=d)
        y = 1.0 + X @ (rng.normal(size=d) * 0.2) + rng.normal(size=n)

        def model(X, y=None):
            a = numpyro.sample("a", dist.Normal(0.0, 10.0))
            b = numpyro.sample("b", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
            sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
            with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
                numpyro.sample("y", dist.Normal(a + X @ b, sigma), obs=y)

        return model, (X, y)
    if name == "logistic_flat":
        X = np.stack([rng.normal(size=n), rng.normal(size=n) * 3000.0 + 20000.0], axis=1)
        logits = -0.5 + 0.8 * X[:, 0] + 0.0005 * (X[:, 1] - 20000.0)
        y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logits))).astype(float)

        def model(X, y=None):
            a = numpyro.sample("a", flat)
            b = numpyro.sample("b", dist.ImproperUniform(constraints.real, (), (2,)))
            with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
                numpyro.sample("y", dist.Bernoulli(logits=a + X @ b), obs=y)

        return model, (X, y)
    if name == "poisson_offset":
        X = rng.normal(size=(n, 3))
        X[:, 1] = 0.8 * X[:, 0] + 0.6 * X[:, 1]
        exposure = rng.uniform(0.5, 20.0, size=n)
        y = rng.poisson(exposure * np.exp(-1.0 + X @ np.array([0.3, -0.2, 0.1]))).astype(float)

        def model(X, log_exposure, y=None):
            a = numpyro.sample("a", dist.Normal(0.0, 5.0))
            b = numpyro.sample("b", dist.Normal(0.0, 2.5).expand([3]).to_event(1))
            with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
                numpyro.sample("y", dist.Poisson(jnp.exp(log_exposure + a + X @ b)), obs=y)

        return model, (X, np.log(exposure), y)
    if name == "mixture":
        z = rng.uniform(size=n) < 0.3
        y = np.where(z, rng.normal(-2.0, 1.0, size=n), rng.normal(3.0, 1.0, size=n))

        def model(y):
            w = numpyro.sample("w", dist.Dirichlet(jnp.ones(2)))
            # ordered means: identifiable (no label switching in NUTS's chains)
            ordered = dist.transforms.OrderedTransform()
            mu = numpyro.sample("mu", dist.TransformedDistribution(dist.Normal(0.0, 5.0).expand([2]), ordered))
            sigma = numpyro.sample("sigma", dist.HalfNormal(3.0))
            mixing = dist.Categorical(probs=w)
            components = dist.Normal(mu, sigma)
            with nf.federated_plate("data", y.shape[0], clients=NUM_CLIENTS):
                numpyro.sample("y", dist.MixtureSameFamily(mixing, components), obs=y)

        return model, (y,)
    if name == "student_t":
        X = rng.normal(size=(n, 2)) * np.array([1.0, 5.0])
        y = 1.0 + X @ np.array([0.7, -0.3]) + rng.standard_t(4.0, size=n)

        def model(X, y=None):
            a = numpyro.sample("a", dist.Normal(0.0, 10.0))
            b = numpyro.sample("b", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
            nu = numpyro.sample("nu", dist.Gamma(2.0, 0.1))
            sigma = numpyro.sample("sigma", dist.HalfCauchy(2.0))
            with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
                numpyro.sample("y", dist.StudentT(nu, a + X @ b, sigma), obs=y)

        return model, (X, y)
    raise ValueError(f"unknown model {name!r}")


def flatten_draws(draws, names):
    """``(S, k)`` draws of the named sites, coordinates concatenated, and their labels."""
    columns, labels = [], []
    for name in names:
        value = np.asarray(draws[name], np.float64)
        value = value.reshape(value.shape[0], -1)
        columns.append(value)
        labels += [name] if value.shape[1] == 1 else [f"{name}[{i}]" for i in range(value.shape[1])]
    return np.concatenate(columns, axis=1), labels


def nuts_reference(model, args, seed=0):
    import jax

    from numpyro.infer import MCMC, NUTS

    mcmc = MCMC(NUTS(model), num_warmup=1000, num_samples=2000, num_chains=2, progress_bar=False)
    mcmc.chain_method = "sequential"
    mcmc.run(jax.random.PRNGKey(seed), *args)
    return mcmc.get_samples()


def compare(draws, reference):
    names = sorted(k for k in reference if k in draws)
    ref, labels = flatten_draws(reference, names)
    got, _ = flatten_draws(draws, names)
    sd = ref.std(0)
    error = np.abs(got.mean(0) - ref.mean(0)) / sd
    ratio = got.std(0) / sd
    return error, ratio, labels


def run_one(name, covariance, num_rounds, seed=0):
    import jax
    import jax.numpy as jnp

    import numpyro_fed as nf

    model, args = build(name, seed)
    dtype = jnp.zeros(()).dtype
    args = tuple(jnp.asarray(a, dtype) for a in args)
    kwargs = {} if covariance is None else {"covariance": covariance}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            method = nf.DPPVI(model, progress_bar=False, **kwargs)
            result = method.run(jax.random.PRNGKey(seed + 1), num_rounds, *args)
            draws = method.get_samples(jax.random.PRNGKey(seed + 2), result, 4000)
        except Exception as e:  # a refusal is a result of the benchmark
            return {"model": name, "refused": f"{type(e).__name__}: {str(e)[:120]}"}
    pvi_time = time.perf_counter() - t0
    t0 = time.perf_counter()
    reference = nuts_reference(model, args, seed)
    nuts_time = time.perf_counter() - t0
    error, ratio, labels = compare(draws, reference)
    ok = bool(np.all(np.isfinite(error)) and error.max() <= MAX_MEAN_ERROR)
    ok &= bool(np.all(ratio >= 1 / MAX_SD_RATIO) and np.all(ratio <= MAX_SD_RATIO))
    runtime = [str(w.message)[:90] for w in caught if issubclass(w.category, RuntimeWarning)]
    return {
        "model": name,
        "max_mean_error": float(error.max()),
        "worst_mean": labels[int(np.argmax(error))],
        "sd_ratio_min": float(ratio.min()),
        "sd_ratio_max": float(ratio.max()),
        "agrees": ok,
        "warned": bool(runtime),
        "warnings": runtime,
        "nuts_s": nuts_time,
        "dppvi_s": pvi_time,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--float32", action="store_true")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--covariance", default=None, help="auto, full or diagonal (default: DPPVI's)")
    parser.add_argument("--num-rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import numpyro

    if not args.float32:
        numpyro.enable_x64()
    rows = []
    print(
        f"{'model':16s} {'mean err':>9s} {'sd ratio':>13s} {'agrees':>6s} {'warned':>6s}  time  "
        f"(float{32 if args.float32 else 64})"
    )
    for name in args.models.split(","):
        row = run_one(name, args.covariance, args.num_rounds, args.seed)
        rows.append(row)
        if "refused" in row:
            print(f"{name:16s} refused: {row['refused']}")
        else:
            print(
                f"{name:16s} {row['max_mean_error']:9.3f} {row['sd_ratio_min']:6.2f}-{row['sd_ratio_max']:<6.2f}"
                f" {str(row['agrees']):>6s} {str(row['warned']):>6s} {row['dppvi_s']:5.0f}s"
                + ("  " + " | ".join(row["warnings"]) if row["warnings"] else "")
            )
        sys.stdout.flush()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
