"""DSVGD against its baselines on the paper's experiments (Kassab & Simeone, Sec. 7).

* ``mixture``: the 1-D Gaussian mixture of App. B.1 (prior N(0, 1), N = 200 particles,
  L = L' = 200): KL(q_opt || KDE of the particles) per round, DSVGD, U-DSVGD, centralised SVGD
  with the same 200 steps per round, and the best any Gaussian can do (a lower bound for
  Gaussian PVI).
* ``adult``: Bayesian logistic regression (w | xi ~ N(0, I / xi), xi ~ Gamma(1, 0.01)) on UCI
  Adult, K = 2 and 20 clients, N = 2 and 6 particles, L = L' = 200, AdaGrad learning rate 0.05:
  accuracy and log predictive density per round.
* ``kin8nm``: BNN regression, one hidden layer of 50 ReLUs, weight prior precision e, noise
  precision ~ Gamma(1, 0.1), K = 2 and 20, N = 20, L = L' = 200, learning rate 0.001, 20
  rounds: RMSE (original units) per round and wall time. The authors' PyTorch code takes
  about 664 s for K = 2 on this machine (RMSE about 0.10 after 20 rounds).

Each configuration prints a table and the script writes every curve to a JSON file.

    python benchmarks/dsvgd.py kin8nm --clients 2
    python benchmarks/dsvgd.py all --json dsvgd.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed import datasets, metrics, partition
from numpyro_fed.infer import svgd

DATA = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "shared", "data")
AUTHORS_KIN8NM_SECONDS = 664.0


# -- models ---------------------------------------------------------------------------------


def mixture_toy(y, shifts, log_scales):
    theta = numpyro.sample("theta", dist.Normal(0, 1))
    with nf.federated_plate("agents", 2, clients=2):
        components = dist.Normal(theta + shifts, jnp.exp(log_scales))
        numpyro.sample("obs", dist.MixtureSameFamily(dist.Categorical(probs=jnp.full(2, 0.5)), components),
                       obs=y)


def make_logistic(clients):
    """The model, with each row's client fixed (the owner array is not a model argument)."""

    def logistic(X, y):
        xi = numpyro.sample("xi", dist.Gamma(1.0, 0.01))
        w = numpyro.sample("w", dist.Normal(0, 1 / jnp.sqrt(xi)).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return logistic


def logistic_probability(draws, X):
    return jax.nn.sigmoid(np.asarray(draws["w"]) @ X.T)


HIDDEN = 50
WEIGHT_SD = math.exp(-0.5)  # prior precision e


def make_bnn(clients):
    def bnn(X, y):
        d = X.shape[1]
        w1 = numpyro.sample("w1", dist.Normal(0, WEIGHT_SD).expand([d, HIDDEN]).to_event(2))
        b1 = numpyro.sample("b1", dist.Normal(0, WEIGHT_SD).expand([HIDDEN]).to_event(1))
        w2 = numpyro.sample("w2", dist.Normal(0, WEIGHT_SD).expand([HIDDEN]).to_event(1))
        b2 = numpyro.sample("b2", dist.Normal(0, WEIGHT_SD))
        gamma = numpyro.sample("gamma", dist.Gamma(1.0, 0.1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            mean = jax.nn.relu(X @ w1 + b1) @ w2 + b2
            numpyro.sample("y", dist.Normal(mean, 1 / jnp.sqrt(gamma)), obs=y)

    return bnn


@jax.jit
def _bnn_forward(w1, b1, w2, b2, X):
    return jax.vmap(lambda a, b, c, e: jax.nn.relu(X @ a + b) @ c + e)(w1, b1, w2, b2)


def bnn_predict(draws, X):
    mean = _bnn_forward(draws["w1"], draws["b1"], draws["w2"], draws["b2"], jnp.asarray(X))
    return np.asarray(mean), 1 / np.sqrt(np.asarray(draws["gamma"]))[:, None]


# -- experiments ----------------------------------------------------------------------------


def run_mixture(rounds: int = 10, num_particles: int = 200):
    from scipy import stats

    toy = datasets.dsvgd_mixture_1d("gaussian")
    grid = np.linspace(-6, 6, 2001)
    kl = svgd.kl_metric_1d("theta", toy.log_posterior, grid)
    args = (jnp.array([1.0, 0.0]), jnp.array([[0.0, 0.0], [3.0, -3.0]]),
            jnp.log(jnp.array([[2.0, 2.0], [1.0, math.sqrt(2.0)]])))
    common = dict(num_particles=num_particles, metrics={"kl": kl}, progress_bar=False)
    methods = {
        "DSVGD": nf.DSVGD(mixture_toy, local_steps=200, distill_steps=200, **common),
        "U-DSVGD": nf.UDSVGD(mixture_toy, local_steps=200, **common),
        "SVGD": svgd.SVGD(mixture_toy, steps_per_round=200, **common),
    }
    draws = toy.posterior.sample(400_000, seed=0)
    gaussian = metrics.kl_1d(toy.log_posterior, stats.norm(draws.mean(), draws.std()).logpdf, grid)
    out = {"best_gaussian_kl": gaussian}
    print(f"\n1-D mixture, N={num_particles}, L=L'=200: KL(q_opt || q) per round "
          f"(best Gaussian: {gaussian:.4f})")
    for name, method in methods.items():
        result = method.run(jax.random.PRNGKey(0), rounds, *args)
        out[name] = {"kl": result.metrics["kl"].tolist(), "wall_time": result.metrics["wall_time"].tolist()}
        print(f"  {name:8s} " + " ".join(f"{v:.4f}" for v in result.metrics["kl"])
              + f"   ({result.metrics['wall_time'][-1]:.1f} s)")
    return out


def _report(name, result, keys):
    m = result.metrics
    cells = "  ".join(f"{k}={float(m[k][-1]):.4f}" for k in keys if k in m)
    print(f"  {name:14s} {cells}  wall {m['wall_time'][-1]:.1f} s")


def run_adult(num_clients: int, num_particles: int, rounds: int = 10):
    data = datasets.load_adult(os.path.join(DATA, "uci_adult"))
    X, y = jnp.asarray(data.X_train), jnp.asarray(data.y_train)
    logistic = make_logistic(partition.even(X.shape[0], num_clients, shuffle=True, seed=0))
    metric = {"test": svgd.classification_metrics(logistic_probability, data.X_test, data.y_test)}
    common = dict(metrics=metric, progress_bar=False)
    methods = {
        "DSVGD": nf.DSVGD(logistic, num_particles=num_particles, local_steps=200, distill_steps=200,
                          learning_rate=0.05, **common),
        "SVGD": svgd.SVGD(logistic, num_particles=num_particles, steps_per_round=200,
                          learning_rate=0.05, **common),
        "FedAvg": svgd.FedAvg(logistic, local_steps=200, learning_rate=0.05, **common),
        "DSGLD": svgd.DistributedSGLD(logistic, num_particles=num_particles, local_steps=200,
                                      a0=1e-4, **common),
    }
    print(f"\nAdult logistic regression, K={num_clients}, N={num_particles}, {rounds} rounds")
    out = {}
    for name, method in methods.items():
        try:
            result = method.run(jax.random.PRNGKey(0), rounds, X, y)
        except ValueError as error:  # non-finite predictions: the method diverged
            print(f"  {name:14s} diverged ({error})")
            out[name] = {"diverged": str(error)}
            continue
        out[name] = {k: np.asarray(v).tolist() for k, v in result.metrics.items()}
        _report(name, result, ["accuracy", "log_predictive_density", "maximum_calibration_error"])
    return out


def run_kin8nm(num_clients: int, rounds: int = 20, num_particles: int = 20, baselines: bool = True):
    data = datasets.load_kin8nm(os.path.join(DATA, "kin8nm"))
    X, y = jnp.asarray(data.X_train), jnp.asarray(data.y_train)
    bnn = make_bnn(partition.even(X.shape[0], num_clients, shuffle=True, seed=0))
    metric = {"test": svgd.regression_metrics(bnn_predict, data.X_test, data.y_test, y_scale=data.y_std)}
    common = dict(metrics=metric, progress_bar=False)
    methods = {
        "DSVGD": nf.DSVGD(bnn, num_particles=num_particles, local_steps=200, distill_steps=200,
                          learning_rate=0.001, **common),
    }
    if baselines:
        methods.update({
            "SVGD": svgd.SVGD(bnn, num_particles=num_particles, steps_per_round=200,
                              learning_rate=0.001, **common),
            "FedAvg": svgd.FedAvg(bnn, local_steps=200, learning_rate=0.001, **common),
            "DSGLD": svgd.DistributedSGLD(bnn, num_particles=num_particles, local_steps=200,
                                          a0=1e-4, **common),
        })
    print(f"\nkin8nm BNN (50 ReLUs), K={num_clients}, N={num_particles}, L=L'=200, {rounds} rounds "
          f"(y_std {data.y_std:.4f}); the authors' code: about {AUTHORS_KIN8NM_SECONDS:.0f} s for K=2")
    out = {}
    for name, method in methods.items():
        start = time.perf_counter()
        try:
            result = method.run(jax.random.PRNGKey(0), rounds, X, y)
        except ValueError as error:  # non-finite predictions: the method diverged
            print(f"  {name:14s} diverged ({error})")
            out[name] = {"diverged": str(error)}
            continue
        total = time.perf_counter() - start
        out[name] = {k: np.asarray(v).tolist() for k, v in result.metrics.items()}
        out[name]["total_seconds"] = total
        _report(name, result, ["rmse", "log_predictive_density"])
        print(f"      RMSE per round: " + " ".join(f"{v:.3f}" for v in result.metrics["rmse"]))
        if name == "DSVGD":
            print(f"      total {total:.1f} s with set-up and compilation: "
                  f"{AUTHORS_KIN8NM_SECONDS / total:.1f}x faster than the authors' {AUTHORS_KIN8NM_SECONDS:.0f} s")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", choices=["mixture", "adult", "kin8nm", "all"])
    parser.add_argument("--clients", type=int, nargs="*", default=None)
    parser.add_argument("--particles", type=int, nargs="*", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--json", default=None, help="write the curves to this file")
    args = parser.parse_args()

    results = {"jax": jax.__version__, "devices": str(jax.devices())}
    if args.experiment in ("mixture", "all"):
        results["mixture"] = run_mixture(rounds=args.rounds or 10)
    if args.experiment in ("adult", "all"):
        for k in args.clients or [2, 20]:
            for n in args.particles or [2, 6]:
                results[f"adult_K{k}_N{n}"] = run_adult(k, n, rounds=args.rounds or 10)
    if args.experiment in ("kin8nm", "all"):
        for k in args.clients or [2, 20]:
            results[f"kin8nm_K{k}"] = run_kin8nm(k, rounds=args.rounds or 20,
                                                 baselines=not args.no_baselines)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
