"""The main demo: Bayesian logistic regression on UCI Adult, split unevenly over 10 clients.

1. Loads Adult (standard preprocessing) and splits the training rows over 10 clients with
   the DP-PVI paper's "unbalanced 1" scheme: half the clients small and nearly all of the
   majority class, half large.
2. Builds the federated potential and checks it against NumPyro's potential energy
   (values and gradients at random points), and times one evaluation of all clients.
3. Finds the MAP by a federated Newton method: each client sends the gradient and Hessian of
   its own term, the server adds them to the prior's and takes a damped Newton step.
4. Runs NUTS on the pooled data as the reference posterior, started at the MAP with the
   Laplace covariance as its (dense) mass matrix. (From a cold start with a diagonal mass
   matrix NUTS needs more than ten minutes here: the one-hot columns of each attribute are
   collinear with the intercept, which leaves long correlated ridges in the posterior.)
5. Runs the federated Zig-Zag sampler (FedZigZag) on the same split: every client proposes
   switching times from its own rows only, with control variates and the Laplace
   preconditioner (its counterpart of NUTS's dense mass matrix, one round of client
   Hessians at the mode), and prints its summary next to NUTS's with both samplers' test
   accuracy and log predictive density, and the marginal W1 between them.

Run with ``make demo`` (or ``python examples/demo.py --data ../shared/data``).
"""

import argparse
import os
import sys
import time
import warnings

import arviz as az
import numpy as np
import pandas as pd

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, init_to_value
from numpyro.infer.util import initialize_model

import numpyro_fed as nf
from numpyro_fed import datasets, metrics, partition

numpyro.enable_x64()
warnings.filterwarnings("ignore", category=FutureWarning)


def logistic_regression(X, y=None, clients=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0, 5))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def timed(fn, *args, repeat=20):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeat


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data", help="folder holding uci_adult/")
    parser.add_argument("--num-clients", type=int, default=10)
    parser.add_argument("--num-warmup", type=int, default=200)
    parser.add_argument("--num-samples", type=int, default=300)
    parser.add_argument("--num-chains", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--zigzag-samples",
        type=int,
        default=100,
        help="FedZigZag draws per chain (each after one unit of process time)",
    )
    args = parser.parse_args()
    # Each line as it is printed, also when the output goes to a file or a pipe (make demo | tee),
    # so a long step never sits behind a full buffer; the progress bars (stderr) show the samplers.
    sys.stdout.reconfigure(line_buffering=True)

    adult = datasets.load_adult(os.path.join(args.data, "uci_adult"), seed=args.seed)
    X, y = jnp.asarray(adult.X_train), jnp.asarray(adult.y_train)
    rho, kappa = partition.DPPVI_SPLITS["unbalanced1"]
    owner = partition.by_label(adult.y_train, args.num_clients, rho=rho, kappa=kappa, seed=args.seed)
    sizes = partition.client_sizes(owner)
    positives = [float(adult.y_train[owner == m].mean()) for m in range(args.num_clients)]
    print(f"UCI Adult: {X.shape[0]} training rows, {X.shape[1]} features, {len(adult.y_test)} test rows")
    print("clients (unbalanced 1: rho=0.75, kappa=0.95):")
    print("  rows     ", " ".join(f"{n:6d}" for n in sizes))
    print("  share >50K", " ".join(f"{p:6.3f}" for p in positives))

    # -- 2. the federated potential, checked against NumPyro ---------------------------
    start = time.perf_counter()
    fp = nf.split_potential(logistic_regression, (X, y), {"clients": owner})
    print(f"\nsplit_potential: {fp} (built and self-checked in {time.perf_counter() - start:.1f} s)")
    reference = initialize_model(
        jax.random.PRNGKey(0), logistic_regression, model_args=(X, y), model_kwargs={"clients": owner}
    ).potential_fn
    ref_value_and_grad = jax.jit(jax.value_and_grad(reference))
    print(
        f"\n{'point':>5} {'prior':>12} {'sum(clients)':>14} {'split total':>14} {'NumPyro':>14} "
        f"{'|diff|':>9} {'max|grad diff|':>14}"
    )
    for k in range(3):
        z = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.PRNGKey(k), a.shape), fp.init_params)
        prior, clients = fp.prior_potential(z), fp.client_potentials(z)
        ref_value, ref_grad = ref_value_and_grad(z)
        grads = fp.prior_grad(z), fp.client_grads(z)
        grad_diff = max(float(jnp.abs(grads[0][s] + grads[1][s].sum(0) - ref_grad[s]).max()) for s in z)
        total = prior + clients.sum()
        print(
            f"{k:5d} {float(prior):12.4f} {float(clients.sum()):14.4f} {float(total):14.4f} "
            f"{float(ref_value):14.4f} {abs(float(total - ref_value)):9.1e} {grad_diff:14.1e}"
        )
    z = fp.init_params
    t_split = timed(fp.client_values_and_grads, z)
    t_pooled = timed(ref_value_and_grad, z)
    print(
        f"\nall {fp.num_clients} clients' values+gradients (one jit(vmap)): {1e3 * t_split:.2f} ms; "
        f"NumPyro pooled value+gradient: {1e3 * t_pooled:.2f} ms (ratio {t_split / t_pooled:.2f})"
    )

    # -- 3. federated Newton to the MAP ---------------------------------------------------
    def client_terms(flat, block):
        return fp.client_potential_fn(fp.unravel(flat), block)

    def prior_term(flat):
        return fp.prior_potential_fn(fp.unravel(flat))

    # Each client's gradient and Hessian from its own block only (vmapped over clients).
    client_derivatives = jax.jit(
        jax.vmap(
            lambda flat, block: (jax.grad(client_terms)(flat, block), jax.hessian(client_terms)(flat, block)),
            in_axes=(None, 0),
        )
    )
    prior_derivatives = jax.jit(lambda flat: (jax.grad(prior_term)(flat), jax.hessian(prior_term)(flat)))
    flat_potential = jax.jit(lambda flat: fp.potential(fp.unravel(flat)))

    start = time.perf_counter()
    flat = jnp.zeros(fp.num_latent)
    for iteration in range(50):
        grads, hessians = client_derivatives(flat, fp.client_data)
        prior_grad, prior_hessian = prior_derivatives(flat)
        gradient, hessian = prior_grad + grads.sum(0), prior_hessian + hessians.sum(0)
        step = jnp.linalg.solve(hessian, gradient)
        current, size = flat_potential(flat), 1.0
        while flat_potential(flat - size * step) > current and size > 1e-8:
            size /= 2  # backtracking keeps Newton stable far from the mode
        flat = flat - size * step
        if float(jnp.abs(size * step).max()) < 1e-9:
            break
    laplace_cov = jnp.linalg.inv(hessian)
    print(
        f"\nfederated Newton: MAP in {iteration + 1} rounds ({time.perf_counter() - start:.1f} s), "
        f"potential {float(flat_potential(flat)):.3f}, |gradient| {float(jnp.abs(gradient).max()):.1e}"
    )

    # -- 4. NUTS on the pooled data: the reference posterior ------------------------------
    print(
        f"\nNUTS on the pooled data ({args.num_chains} chains x {args.num_warmup} warmup + "
        f"{args.num_samples} samples, dense mass = Laplace covariance; about 20 s on an idle 2-core "
        "machine, progress bars below):"
    )
    kernel = NUTS(
        logistic_regression,
        dense_mass=True,
        inverse_mass_matrix=laplace_cov,
        adapt_mass_matrix=False,
        init_strategy=init_to_value(values=fp.postprocess_fn(fp.unravel(flat))),
    )
    mcmc = MCMC(
        kernel,
        num_warmup=args.num_warmup,
        num_samples=args.num_samples,
        num_chains=args.num_chains,
        chain_method="sequential",
        progress_bar=True,
    )
    start = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(args.seed), X, y, clients=owner, extra_fields=("num_steps",))
    jax.block_until_ready(mcmc.get_samples())
    steps = float(mcmc.get_extra_fields()["num_steps"].mean())
    print(f"  {time.perf_counter() - start:.1f} s, {steps:.1f} gradient evaluations per draw")
    idata = nf.to_inference_data(mcmc, potential=fp)
    samples = mcmc.get_samples()
    summary = az.summary(idata, var_names=["b", "w"], round_to=3)
    summary.index = ["b (intercept)"] + [f"w[{name}]" for name in adult.feature_names]
    largest = summary.iloc[1:].reindex(summary["mean"].iloc[1:].abs().sort_values(ascending=False).index)
    print(pd.concat([summary.iloc[:1], largest.head(12)]).to_string())
    print(
        f"  ... ({len(summary)} parameters; min ESS bulk {summary['ess_bulk'].min():.0f}, "
        f"max r_hat {summary['r_hat'].max():.3f})"
    )
    print(
        f"  attrs: algorithm={idata.attrs['algorithm']}, num_clients={idata.attrs['num_clients']}, "
        f"client_sizes={idata.attrs['client_sizes']}"
    )

    def predictive(samples):
        logits = jnp.asarray(adult.X_test) @ samples["w"].T + samples["b"]  # (n_test, S)
        probs = jax.nn.sigmoid(logits).mean(1)
        log_lik = dist.Bernoulli(logits=logits.T).log_prob(jnp.asarray(adult.y_test))
        return (metrics.accuracy(np.asarray(probs), adult.y_test), metrics.log_predictive_density(np.asarray(log_lik)))

    nuts_fit = predictive(mcmc.get_samples())
    print(f"  test accuracy {nuts_fit[0]:.4f}, log predictive density {nuts_fit[1]:.4f}")

    # -- 5. FedZigZag: federated, asymptotically exact ----------------------------------
    print(
        f"\nFedZigZag over the {args.num_clients} clients (control variates, Laplace preconditioner, "
        f"{args.num_chains} vectorized chains x {args.zigzag_samples} draws one unit of process time "
        "apart, after 20 warm-up draws; about 3 minutes on an idle 2-core machine at the defaults, "
        "a progress bar below):"
    )
    zigzag = nf.FedZigZag(logistic_regression, sample_interval=1.0, preconditioner="laplace")
    # Vectorized chains share each pass over the clients' rows, which dominates the cost here.
    fed = MCMC(
        zigzag,
        num_warmup=20,
        num_samples=args.zigzag_samples,
        num_chains=args.num_chains,
        chain_method="vectorized",
        progress_bar=True,
    )
    start = time.perf_counter()
    map_point = jax.tree.map(lambda a: jnp.broadcast_to(a, (args.num_chains,) + a.shape), fp.unravel(flat))
    fed.run(
        jax.random.PRNGKey(args.seed + 1),
        X,
        y,
        clients=owner,
        init_params=map_point,
        extra_fields=("info.num_proposals",),
    )
    jax.block_until_ready(fed.get_samples())
    fed_idata = nf.to_inference_data(fed)
    stats = fed_idata.sample_stats
    print(
        f"  {time.perf_counter() - start:.1f} s: {int(stats['num_events'].sum())} switches from "
        f"{int(fed.get_extra_fields()['info.num_proposals'].sum())} proposals, "
        f"{int(stats['num_violations'].sum())} bound violations; switches by client: "
        f"{np.asarray(stats['events_by_client'].sum(('chain', 'draw'))).tolist()}, "
        f"by the prior: {int(stats['events_by_prior'].sum())}"
    )
    fed_summary = az.summary(fed_idata, var_names=["b", "w"], round_to=3)
    fed_summary.index = summary.index
    shown = ["b (intercept)"] + list(largest.head(8).index)
    side = pd.concat(
        {
            "NUTS (pooled)": summary.loc[shown, ["mean", "sd", "ess_bulk"]],
            "FedZigZag": fed_summary.loc[shown, ["mean", "sd", "ess_bulk"]],
        },
        axis=1,
    )
    print(side.to_string())
    fed_draws = fed.get_samples()
    flat_fed = np.concatenate([np.asarray(fed_draws["b"])[:, None], np.asarray(fed_draws["w"])], 1)
    flat_nuts = np.concatenate([np.asarray(samples["b"])[:, None], np.asarray(samples["w"])], 1)
    w1 = metrics.marginal_w1(flat_fed, flat_nuts) / flat_nuts.std(0)
    print(
        f"  marginal W1 to NUTS in NUTS posterior sds: median {np.median(w1):.3f}, max {w1.max():.3f} "
        f"(min ESS bulk {fed_summary['ess_bulk'].min():.0f}: Monte Carlo error alone gives about "
        f"1/sqrt(ESS) = {1 / np.sqrt(fed_summary['ess_bulk'].min()):.2f}); max r_hat "
        f"{fed_summary['r_hat'].max():.3f}"
    )
    fed_fit = predictive(fed_draws)
    print(
        f"  test accuracy {fed_fit[0]:.4f} (NUTS {nuts_fit[0]:.4f}), log predictive density "
        f"{fed_fit[1]:.4f} (NUTS {nuts_fit[1]:.4f})"
    )


if __name__ == "__main__":
    main()
