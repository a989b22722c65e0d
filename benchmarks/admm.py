"""Benchmark of D-ADMMS and its baselines: Section 6 of Tzikas et al. (2024).

* **Section 6.2, linear regression** (Figures 1-2): x in R^2, xi = 4, lambda = 10,
  n_i in {50, 200} rows per agent, N in {5, 20, 100} agents, complete / ring / no-edge graphs,
  100 independent chains started at N(0, I). Per iteration: W2 between the Gaussian fitted
  to agent 0's iterates (over chains) and the exact posterior, and the same for the network
  average. Methods: D-ADMMS (rho = 5), C-ADMM (no noise), D-SGLD (eta = 0.009), D-SGHMC
  (eta = 0.1, gamma = 7), D-ULA (chi_1 = 0.55 on complete graphs, else 0.05; chi_2 = 0.05).
* **Figure 3, rho ablation**: D-ADMMS on a ring of 20 agents, n_i = 50, rho in
  {1, 5, 10, 20, 50, 100, 200, 500, 1000}.
* **Section 6.3, logistic regression** (Figure 6): x in R^3, z ~ N(0, 20 I), n_i = 50,
  N in {5, 20, 50}, the same graphs; accuracy of agent 0's iterate on the pooled data
  (mean and sd over chains) per iteration, over Figure 6's horizon (30 iterations for
  N = 5, 15 for N = 20 and 50; ``--logistic-iterations`` overrides). D-SGLD eta = 0.0003, D-SGHMC eta = 0.02,
  gamma = 30, D-ULA chi = 0.9 / 0.9 on the complete graph of 50 agents.
* **Speed**: the 5-agent ring x 100 chains x 100 iterations (linear regression), as users
  run it (``MCMC.run`` wall time, including set-up and compilation) and the bare iteration
  (``jax.jit`` of the vmapped kernel in a ``lax.scan``, compiled beforehand), and NumPyro NUTS
  on the pooled posterior in the same process as a reference.

Everything runs in float64 through ``MCMC(kernel, num_chains=100, chain_method="vectorized")``.
Run ``python benchmarks/admm.py`` or ``--quick`` (N = 5 only: 8 minutes on a shared 2-core
CPU). On that machine the linear-regression section took about 13 minutes, the rho ablation
about 1 and the logistic regression about 4 (5 agents) and 5 (20 agents); the logistic runs with
50 agents (Newton solves for 5000 agent-chains per iteration) are the slowest part and were not
timed. ``--sections`` picks parts. Results: tables on stdout and ``benchmarks/results/admm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from pathlib import Path

import numpy as np

import numpyro

numpyro.enable_x64()

import jax  # noqa: E402
from jax import lax  # noqa: E402

import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.datasets import dadmms_linear, dadmms_logistic  # noqa: E402
from numpyro_fed.infer.admm import DisconnectedTopologyWarning  # noqa: E402
from numpyro_fed.metrics import gaussian_w2_from_samples  # noqa: E402

METHODS = ("DADMMS", "ADMM", "DSGLD", "DSGHMC", "DULA")
TOPOLOGIES = ("complete", "ring", "none")


def linear_model(problem):
    """Eq. (27): prior N(0, lambda I), Gaussian likelihood with sd xi; agents own their rows."""

    def model(X, y=None):
        x = numpyro.sample("x", dist.Normal(0, np.sqrt(problem.prior_variance)).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=problem.owner):
            numpyro.sample("y", dist.Normal(X @ x, problem.noise_std), obs=y)

    return model


def logistic_model(problem):
    """Eq. (30): prior N(0, lambda I), Bernoulli likelihood."""

    def model(X, y=None):
        x = numpyro.sample("x", dist.Normal(0, np.sqrt(problem.prior_variance)).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=problem.owner):
            numpyro.sample("y", dist.Bernoulli(logits=X @ x), obs=y)

    return model


def make_kernel(method, model, topology, num_agents, task, rho=5.0):
    if method == "DADMMS":
        return nf.DADMMS(model, topology=topology, rho=rho)
    if method == "ADMM":
        return nf.ADMM(model, topology=topology, rho=rho)
    if method == "DSGLD":
        return nf.DSGLD(model, topology=topology, step_size=0.009 if task == "linear" else 0.0003)
    if method == "DSGHMC":
        if task == "linear":
            return nf.DSGHMC(model, topology=topology, step_size=0.1, friction=7.0)
        return nf.DSGHMC(model, topology=topology, step_size=0.02, friction=30.0)
    if method == "DULA":
        if topology == "complete" and task == "logistic" and num_agents >= 50:
            return nf.DULA(model, topology=topology, chi1=0.9, chi2=0.9)
        return nf.DULA(model, topology=topology)  # chi1 = 0.55 on complete graphs, else 0.05
    raise ValueError(method)


def save(results, out):
    """Write the results so far (after every configuration: a stopped run keeps what it did)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out)


def run(kernel, problem, iterations, chains, seed):
    mcmc = MCMC(
        kernel, num_warmup=0, num_samples=iterations, num_chains=chains, chain_method="vectorized", progress_bar=False
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DisconnectedTopologyWarning)
        mcmc.run(jax.random.PRNGKey(seed), problem.X, problem.y)
        # every agent's draws of x, (chains, iterations, agents, d), and the network average
        samples = {
            "agents": jax.device_get(kernel.agent_draws(mcmc, group_by_chain=True)["x"]),
            "average": jax.device_get(kernel.network_average(mcmc, group_by_chain=True)["x"]),
        }
    return samples, time.perf_counter() - start


def bare_iteration_seconds(kernel, problem, chains=100, iterations=100):
    """One iteration of all agents and chains: the kernel's vmapped sample function in a
    compiled scan, timed on its second call (compilation excluded)."""
    state = kernel.init(jax.random.split(jax.random.PRNGKey(0), chains), 0, None, (problem.X, problem.y), {})
    scan = jax.jit(lambda s: lax.scan(lambda c, _: (kernel.sample(c, (), {}), None), s, None, length=iterations)[0])
    jax.block_until_ready(scan(state))
    start = time.perf_counter()
    jax.block_until_ready(scan(state))
    return (time.perf_counter() - start) / iterations


def w2_curve(draws, problem):
    """W2 per iteration of the Gaussian fitted over chains; ``draws``: (chains, iterations, d)."""
    return [
        gaussian_w2_from_samples(draws[:, k], problem.posterior_mean, problem.posterior_cov)
        for k in range(draws.shape[1])
    ]


def linear_section(args, results):
    print("\n## Section 6.2: linear regression, W2 to the exact posterior (agent 0 / network average)")
    print(
        f"{'n_i':>4} {'N':>4} {'graph':>9} {'method':>7} | {'ag@10':>6} {'ag@30':>6} {'ag@end':>6} | "
        f"{'avg@10':>6} {'avg@end':>7} | {'iters':>5} {'run s':>6}"
    )
    for n_i in args.rows:
        for num_agents in args.agents:
            problem = dadmms_linear(args.seed, num_agents=num_agents, n_per_agent=n_i)
            iterations = 100 if num_agents < 100 else 50
            for topology in TOPOLOGIES:
                for method in args.methods:
                    kernel = make_kernel(method, linear_model(problem), topology, num_agents, "linear")
                    samples, seconds = run(kernel, problem, iterations, args.chains, args.seed)
                    agent = np.asarray(samples["agents"][:, :, 0])
                    ag, avg = w2_curve(agent, problem), w2_curve(np.asarray(samples["average"]), problem)
                    results["linear"].append(
                        dict(
                            n_i=n_i,
                            num_agents=num_agents,
                            topology=topology,
                            method=method,
                            w2_agent0=ag,
                            w2_average=avg,
                            run_seconds=seconds,
                            load_average=os.getloadavg()[0],
                        )
                    )
                    save(results, args.out_path)
                    print(
                        f"{n_i:>4} {num_agents:>4} {topology:>9} {method:>7} | {ag[9]:6.3f} {ag[29]:6.3f} "
                        f"{ag[-1]:6.3f} | {avg[9]:6.3f} {avg[-1]:7.3f} | {iterations:>5} {seconds:6.1f}",
                        flush=True,
                    )


def rho_section(args, results):
    print("\n## Figure 3: rho ablation, D-ADMMS, ring of 20 agents, n_i = 50 (W2 of agent 0)")
    problem = dadmms_linear(args.seed, num_agents=20, n_per_agent=50)
    print(f"{'rho':>7} | {'@5':>6} {'@10':>6} {'@20':>6} {'@50':>6}")
    for rho in args.rhos:
        samples, seconds = run(
            nf.DADMMS(linear_model(problem), topology="ring", rho=rho), problem, 50, args.chains, args.seed
        )
        ag = w2_curve(np.asarray(samples["agents"][:, :, 0]), problem)
        results["rho"].append(dict(rho=rho, w2_agent0=ag, run_seconds=seconds, load_average=os.getloadavg()[0]))
        save(results, args.out_path)
        print(f"{rho:7g} | {ag[4]:6.3f} {ag[9]:6.3f} {ag[19]:6.3f} {ag[49]:6.3f}", flush=True)


def accuracy_curves(draws, X, y):
    """Accuracy on the pooled data of each chain's iterate: (chains, iterations)."""
    logits = np.einsum("nd,ckd->ckn", X, draws)
    return ((logits >= 0) == (y[None, None, :] == 1)).mean(-1)


def logistic_section(args, results):
    print("\n## Section 6.3: logistic regression, accuracy of agent 0 on the pooled data (mean +- sd over chains)")
    print(f"{'N':>4} {'graph':>9} {'method':>7} | {'@5':>11} {'@15':>11} {'@end':>11} | {'run s':>6}")
    for num_agents in args.logistic_agents:
        problem = dadmms_logistic(args.seed, num_agents=num_agents, n_per_agent=50)
        nuts = MCMC(NUTS(logistic_model(problem)), num_warmup=500, num_samples=1000, progress_bar=False)
        nuts.run(jax.random.PRNGKey(args.seed), problem.X, problem.y)
        mean = np.asarray(nuts.get_samples()["x"].mean(0))
        reference = float(((problem.X @ mean >= 0) == (problem.y == 1)).mean())
        print(f"{num_agents:>4} {'pooled':>9} {'NUTS':>7} | posterior-mean accuracy {reference:.3f}")
        iterations = args.logistic_iterations or (30 if num_agents <= 5 else 15)  # Figure 6's horizon
        for topology in TOPOLOGIES:
            for method in args.methods:
                kernel = make_kernel(method, logistic_model(problem), topology, num_agents, "logistic")
                samples, seconds = run(kernel, problem, iterations, args.chains, args.seed)
                acc = accuracy_curves(np.asarray(samples["agents"][:, :, 0]), problem.X, problem.y)
                m, s = acc.mean(0), acc.std(0)
                results["logistic"].append(
                    dict(
                        num_agents=num_agents,
                        topology=topology,
                        method=method,
                        accuracy_mean=m.tolist(),
                        accuracy_sd=s.tolist(),
                        nuts_accuracy=reference,
                        run_seconds=seconds,
                        load_average=os.getloadavg()[0],
                    )
                )
                save(results, args.out_path)
                cell = lambda k: f"{m[k]:.3f}+-{s[k]:.3f}"  # noqa: E731
                print(
                    f"{num_agents:>4} {topology:>9} {method:>7} | {cell(4)} {cell(min(14, iterations - 1))} "
                    f"{cell(-1)} | {seconds:6.1f}",
                    flush=True,
                )


def speed_section(args, results):
    print("\n## Speed: 5-agent ring x 100 chains x 100 iterations, linear regression (n_i = 50)")
    problem = dadmms_linear(args.seed, num_agents=5, n_per_agent=50)
    rows = []
    for method in args.methods:
        kernel = make_kernel(method, linear_model(problem), "ring", 5, "linear")
        run(kernel, problem, 100, 100, args.seed)  # warm JAX's caches
        _, first = run(kernel, problem, 100, 100, args.seed + 1)
        bare = bare_iteration_seconds(kernel, problem)
        rows.append(
            dict(
                method=method,
                solver=getattr(kernel, "solver_used", None),
                mcmc_run_seconds=first,
                bare_seconds_per_iteration=bare,
                load_average=os.getloadavg()[0],
            )
        )
        print(
            f"{method:>7}: MCMC.run {first:6.2f} s (set-up and compilation included, "
            f"{first / 100 * 1e3:6.2f} ms per iteration); bare iteration {bare * 1e6:8.1f} us "
            f"({getattr(kernel, 'solver_used', '') or 'gradient'})",
            flush=True,
        )
    logistic = dadmms_logistic(args.seed, num_agents=5, n_per_agent=50)
    kernel = nf.DADMMS(logistic_model(logistic), topology="ring", rho=5.0)
    run(kernel, logistic, 100, 100, args.seed)
    _, first = run(kernel, logistic, 100, 100, args.seed + 1)
    bare = bare_iteration_seconds(kernel, logistic)
    rows.append(
        dict(
            method="DADMMS-logistic",
            solver=kernel.solver_used,
            mcmc_run_seconds=first,
            bare_seconds_per_iteration=bare,
            load_average=os.getloadavg()[0],
        )
    )
    print(f"DADMMS logistic (Newton): MCMC.run {first:6.2f} s, bare iteration {bare * 1e6:8.1f} us")
    nuts = MCMC(NUTS(linear_model(problem)), num_warmup=500, num_samples=1000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(0), problem.X, problem.y)
    start = time.perf_counter()
    nuts.run(jax.random.PRNGKey(1), problem.X, problem.y)
    jax.block_until_ready(nuts.get_samples())
    nuts_seconds = time.perf_counter() - start
    rows.append(
        dict(
            method="NUTS (pooled, 1 chain, 500 + 1000)", mcmc_run_seconds=nuts_seconds, load_average=os.getloadavg()[0]
        )
    )
    print(f"NUTS on the pooled posterior (1 chain, 500 warm-up + 1000 draws): {nuts_seconds:.2f} s per run")
    print(
        "Reference (issue 4): the authors' cvxpy code takes about 5 ms per linear proximal solve,"
        " i.e. about 2.5 s per iteration of this configuration (5 agents x 100 chains)."
    )
    results["speed"] = rows
    save(results, args.out_path)


def report(path):
    """Markdown tables (as in ``benchmarks/admm.md``) from a results file of this script."""
    results = json.loads(Path(path).read_text())
    lines = []

    def fmt(v):  # diverging runs reach 1e16
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1e}"

    if results.get("speed"):
        lines += [
            "| method | solver | `MCMC.run`, 100 iterations (s) | bare iteration (ms) | load average |",
            "|---|---|---|---|---|",
        ]
        for r in results["speed"]:
            bare = r.get("bare_seconds_per_iteration")
            lines.append(
                f"| {r['method']} | {r.get('solver') or '-'} | {r['mcmc_run_seconds']:.2f} | "
                f"{'-' if bare is None else f'{bare * 1e3:.3f}'} | {r.get('load_average', float('nan')):.1f} |"
            )
        lines.append("")
    marks = (1, 5, 10, 20, 30, 50, 100)
    if results.get("linear"):
        for n_i in sorted({r["n_i"] for r in results["linear"]}):
            lines += [
                f"W2 to the exact posterior, n_i = {n_i}: agent 0 / network average at iterations {marks}.",
                "",
                "| N | graph | method | agent 0 | average | run (s) |",
                "|---|---|---|---|---|---|",
            ]
            for r in results["linear"]:
                if r["n_i"] != n_i:
                    continue
                cells = [
                    (fmt(r["w2_agent0"][k - 1]), fmt(r["w2_average"][k - 1])) for k in marks if k <= len(r["w2_agent0"])
                ]
                lines.append(
                    f"| {r['num_agents']} | {r['topology']} | {r['method']} | "
                    f"{' '.join(c[0] for c in cells)} | {' '.join(c[1] for c in cells)} | "
                    f"{r['run_seconds']:.1f} |"
                )
            lines.append("")
    if results.get("rho"):
        lines += [
            f"rho ablation (20-agent ring, n_i = 50): W2 of agent 0 at iterations {marks[:-1]}.",
            "",
            "| rho | agent 0 | run (s) |",
            "|---|---|---|",
        ]
        for r in results["rho"]:
            cells = [fmt(r["w2_agent0"][k - 1]) for k in marks[:-1]]
            lines.append(f"| {r['rho']:g} | {' '.join(cells)} | {r['run_seconds']:.1f} |")
        lines.append("")
    if results.get("logistic"):
        marks = (1, 2, 3, 5, 10, 15, 30)
        lines += [
            f"Logistic regression: accuracy of agent 0 on the pooled data, mean over chains at "
            f"iterations {marks} (sd at the last iteration).",
            "",
            "| N | graph | method | accuracy | sd at end | NUTS mean | run (s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in results["logistic"]:
            m = r["accuracy_mean"]
            cells = [f"{m[k - 1]:.3f}" for k in marks if k <= len(m)]
            lines.append(
                f"| {r['num_agents']} | {r['topology']} | {r['method']} | {' '.join(cells)} | "
                f"{r['accuracy_sd'][-1]:.3f} | {r['nuts_accuracy']:.3f} | {r['run_seconds']:.1f} |"
            )
        lines.append("")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 5 only (linear and logistic), fewer rho values")
    parser.add_argument("--chains", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["speed", "linear", "rho", "logistic"],
        choices=["speed", "linear", "rho", "logistic"],
    )
    parser.add_argument(
        "--logistic-iterations",
        type=int,
        default=None,
        help="iterations of the logistic runs (default: Figure 6's, 30 for N = 5, else 15)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "admm.json"))
    parser.add_argument("--report", metavar="JSON", help="print markdown tables of a results file and exit")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    args.out_path = Path(args.out)
    args.rows = [50, 200]
    args.agents = [5] if args.quick else [5, 20, 100]
    args.logistic_agents = [5] if args.quick else [5, 20, 50]
    args.rhos = [1.0, 5.0, 50.0, 1000.0] if args.quick else [1.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]

    results = {
        "platform": platform.platform(),
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "chains": args.chains,
        "seed": args.seed,
        "sections": args.sections,
        "linear": [],
        "rho": [],
        "logistic": [],
    }
    start = time.perf_counter()
    sections = {"speed": speed_section, "linear": linear_section, "rho": rho_section, "logistic": logistic_section}
    for name in args.sections:
        sections[name](args, results)
    results["total_seconds"] = time.perf_counter() - start
    save(results, args.out_path)
    print(f"\ntotal {results['total_seconds']:.0f} s; results in {args.out_path}")


if __name__ == "__main__":
    main()
