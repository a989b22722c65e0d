"""Runs one zoo case in this (child) process and writes a JSON summary.

``python -m zoo.worker run CASE ALGORITHM DTYPE OUT.json`` (with ``tests/`` on the path)
runs an algorithm with its default settings at the user-level run lengths of
:data:`RUN_LENGTHS`; ``python -m zoo.worker reference CASE OUT.json`` runs NUTS on the pooled
reference model in float64. The dtype must be fixed before JAX is imported, so the parent
sets ``JAX_ENABLE_X64`` in the child's environment (see :mod:`zoo.harness`).

The summary holds, per flat unconstrained coordinate, the mean, the sd, the effective sample
sizes of the draws and of their squared deviations, and the kurtosis; or the exception (type,
message, whether the package raised it on purpose); and every warning raised during the run.
"""

import json
import os
import sys
import time
import traceback
import warnings

import numpy as np

# The run lengths a user would pick; every other setting is the algorithm's default.
RUN_LENGTHS = {
    # MCMC(FedZigZag(model), num_warmup=500, num_samples=1000): one chain.
    "FedZigZag": dict(num_warmup=500, num_samples=1000),
    # MCMC(DADMMS(model), num_warmup=50, num_samples=50, num_chains=100,
    # chain_method="vectorized"): the paper's protocol, independent runs of the network.
    "DADMMS": dict(num_warmup=50, num_samples=50, num_chains=100),
    # DSVGD(model).run(key, num_rounds=max(10, 2 M)): every client scheduled at least twice;
    # get_samples(key, result, 2000).
    "DSVGD": dict(min_rounds=10, rounds_per_client=2, num_samples=2000),
    # DPPVI(model).run(key, num_rounds=10): every client updates 10 times;
    # get_samples(key, result, 2000).
    "DPPVI": dict(num_rounds=10, num_samples=2000),
}
# The real-model tier (zoo.real_models) runs as its issues measured: 1000 warmup steps and 2000
# draws (DADMMS: 20 vectorized chains of 100 draws after 1000 warmup steps); DSVGD and DPPVI
# as above.
REAL_RUN_LENGTHS = {
    "FedZigZag": dict(num_warmup=1000, num_samples=2000),
    "DADMMS": dict(num_warmup=1000, num_samples=100, num_chains=20),
    "DSVGD": RUN_LENGTHS["DSVGD"],
    "DPPVI": RUN_LENGTHS["DPPVI"],
}
ALGORITHMS = tuple(RUN_LENGTHS)
PACKAGE_DIR = os.path.join("numpyro_fed", "")


def _phase(record, name):
    record["phase"] = name


def _draws_from_idata(idata, sites):
    posterior = idata.posterior
    return {name: np.asarray(posterior[name].values) for name in sites}


def _run_algorithm(algorithm, case, model, args, rng_key, record, sites):
    """Constrained draws ``{site: (chains, draws, *shape)}``."""
    import jax

    from numpyro.infer import MCMC

    import numpyro_fed as nf

    lengths = (REAL_RUN_LENGTHS if case.tier == "real" else RUN_LENGTHS)[algorithm]
    if algorithm == "FedZigZag":
        _phase(record, "construct")
        kernel = nf.FedZigZag(model)
        _phase(record, "run")
        mcmc = MCMC(kernel, num_warmup=lengths["num_warmup"], num_samples=lengths["num_samples"], progress_bar=False)
        mcmc.run(rng_key, *args)
        _phase(record, "results")
        return _draws_from_idata(nf.to_inference_data(mcmc), sites)
    if algorithm == "DADMMS":
        _phase(record, "construct")
        kernel = nf.DADMMS(model)
        _phase(record, "run")
        mcmc = MCMC(
            kernel,
            num_warmup=lengths["num_warmup"],
            num_samples=lengths["num_samples"],
            num_chains=lengths["num_chains"],
            chain_method="vectorized",
            progress_bar=False,
        )
        mcmc.run(rng_key, *args)
        _phase(record, "results")
        return _draws_from_idata(nf.to_inference_data(mcmc), sites)
    run_key, draw_key = jax.random.split(rng_key)
    if algorithm == "DSVGD":
        _phase(record, "construct")
        method = nf.DSVGD(model, progress_bar=False)
        num_rounds = max(lengths["min_rounds"], lengths["rounds_per_client"] * case.num_clients)
        _phase(record, "run")
        result = method.run(run_key, num_rounds, *args)
    elif algorithm == "DPPVI":
        _phase(record, "construct")
        method = nf.DPPVI(model, progress_bar=False)
        _phase(record, "run")
        result = method.run(run_key, lengths["num_rounds"], *args)
    else:
        raise KeyError(algorithm)
    _phase(record, "results")
    params = method.get_params(result.state) if algorithm == "DPPVI" else {}
    # the fitted q itself, flat in the order of ``sites`` (the server's q holds the global sites
    # only: with client-local ones the draws are compared instead)
    if algorithm == "DPPVI" and case.tier == "synthetic" and all(name in params["loc"] for name in sites):
        record["q"] = {
            k: np.concatenate([np.asarray(params[k][name], np.float64).ravel() for name in sites]).tolist()
            for k in ("loc", "scale")
        }
        # a full-rank q's family holds the posterior itself where it is Gaussian; a mean-field
        # q's, the best mean-field Gaussian
        record["q"]["full_rank"] = bool(method.full_rank(method.federated_potential.num_latent))
    draws = method.get_samples(draw_key, result, lengths["num_samples"])
    return {name: np.asarray(draws[name])[None] for name in sites}


def _run_hang(model, args, record):
    """A jitted loop that never ends: proves that the harness's time budget holds."""
    import jax
    import jax.numpy as jnp

    _phase(record, "run")
    x = jax.jit(lambda x: jax.lax.while_loop(lambda c: c > 0.0, lambda c: jnp.abs(jnp.sin(c)) + 0.5, x))(jnp.ones(()))
    float(x)


def latent_sites(model, args):
    """``{site: support}`` of the latent sample sites, in the order the model samples them."""
    import jax

    from numpyro import handlers
    from numpyro.infer.initialization import init_to_uniform

    # values from an init strategy, not prior draws: an ImproperUniform (flat) prior has none
    seeded = handlers.substitute(handlers.seed(model, jax.random.PRNGKey(0)), substitute_fn=init_to_uniform)
    tr = handlers.trace(seeded).get_trace(*args)
    return {
        name: site["fn"].support
        for name, site in tr.items()
        if site["type"] == "sample" and not site["is_observed"] and not site.get("infer", {}).get("is_auxiliary")
    }


def summarise(draws, supports):
    """Per-coordinate moments of the flat unconstrained draws (``draws[site]``: ``(chains,
    draws, *shape)``), ESS with each chain split in two halves (so a drifting chain lowers it)."""
    import jax.numpy as jnp

    from numpyro.diagnostics import effective_sample_size
    from numpyro.distributions.transforms import biject_to

    names, columns = [], []
    for name, support in supports.items():
        value = np.asarray(draws[name], dtype=np.float64)
        with np.errstate(all="ignore"):
            u = np.asarray(biject_to(support).inv(jnp.asarray(value)), dtype=np.float64)
        chains, num = u.shape[:2]
        flat = u.reshape(chains, num, -1)
        columns.append(flat)
        size = flat.shape[-1]
        names += [name] if size == 1 and u.ndim == 2 else [f"{name}[{i}]" for i in range(size)]
    x = np.concatenate(columns, axis=-1)  # (chains, draws, D)
    finite = np.isfinite(x)
    out = {"coordinates": names, "shape": list(x.shape), "num_nonfinite": int((~finite).sum())}
    if not finite.all():
        return out
    chains, num, _ = x.shape
    if num >= 4:
        half = num // 2
        split = np.concatenate([x[:, :half], x[:, half : 2 * half]], axis=0)
    else:
        split = x
    flat = x.reshape(-1, x.shape[-1])
    mean, sd = flat.mean(0), flat.std(0)
    centred = flat - mean
    with np.errstate(all="ignore"):
        kurtosis = (centred**4).mean(0) / np.maximum(sd, 1e-300) ** 4
    out.update(
        mean=mean.tolist(),
        sd=sd.tolist(),
        kurtosis=np.nan_to_num(kurtosis, nan=3.0).tolist(),
        max_abs=float(np.abs(flat).max()),
    )
    if split.shape[1] >= 2 and np.all(sd > 0):
        ess = np.asarray(effective_sample_size(split))
        ess_sq = np.asarray(effective_sample_size((split - mean) ** 2))
    else:
        ess = ess_sq = np.full(x.shape[-1], float(flat.shape[0]))
    total = float(flat.shape[0])
    out["ess_mean"] = np.clip(np.nan_to_num(ess, nan=1.0), 1.0, total).tolist()
    out["ess_sd"] = np.clip(np.nan_to_num(ess_sq, nan=1.0), 1.0, total).tolist()
    return out


def _raised_by_package(exc) -> bool:
    """The exception was raised by the package's own code (a deliberate, worded error)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and PACKAGE_DIR in frames[-1].filename and "numpyro_fed" in frames[-1].filename


def _cast(args, dtype):
    import jax.numpy as jnp

    return tuple(
        jnp.asarray(a, dtype) if np.issubdtype(np.asarray(a).dtype, np.floating) else jnp.asarray(a) for a in args
    )


def run(case_name, algorithm, dtype, out_path, seed=0):
    import jax

    import numpyro_fed

    from zoo.models import get_case

    record = {
        "case": case_name,
        "algorithm": algorithm,
        "dtype": dtype,
        "phase": "setup",
        "x64": bool(jax.config.jax_enable_x64),
        "package": os.path.dirname(numpyro_fed.__file__),
    }
    case = get_case(case_name)
    model, args = case.build()
    args = _cast(args, dtype)
    supports = latent_sites(model, args)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if algorithm == "_hang":
                _run_hang(model, args, record)
                draws = None
            else:
                draws = _run_algorithm(algorithm, case, model, args, jax.random.PRNGKey(seed), record, supports)
            record["status"] = "completed"
        except Exception as exc:  # classified by the parent
            record["status"] = "error"
            record["error"] = {
                "type": type(exc).__name__,
                "message": str(exc)[:2000],
                "by_package": _raised_by_package(exc),
                "traceback": traceback.format_exc()[-3000:],
            }
            draws = None
    record["seconds"] = time.perf_counter() - start
    record["warnings"] = [
        {"category": w.category.__name__, "message": str(w.message)[:1000], "filename": w.filename} for w in caught
    ]
    if draws is not None:
        record["summary"] = summarise(draws, supports)
    _write(out_path, record)


def reference(case_name, out_path):
    """NUTS on the pooled reference model, float64, 2 chains x 3000 draws after 1000 of warmup."""
    import jax

    from numpyro.infer import MCMC, NUTS

    from zoo.models import get_case

    case = get_case(case_name)
    model, args = (case.reference_model or case.build)()
    args = _cast(args, np.float64)
    supports = latent_sites(*case.build()[:1], _cast(case.build()[1], np.float64))
    start = time.perf_counter()
    mcmc = MCMC(
        NUTS(model, **case.nuts),
        num_warmup=1000,
        num_samples=case.reference_draws,
        num_chains=2,
        chain_method="sequential",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(12), *args)
    draws = {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    divergences = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
    summary = summarise(draws, supports)
    _write(
        out_path,
        {
            "case": case_name,
            "kind": "nuts",
            "seconds": time.perf_counter() - start,
            "divergences": divergences,
            "summary": summary,
        },
    )


def _write(path, record):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "run":
        run(*sys.argv[2:6])
    elif command == "reference":
        reference(*sys.argv[2:4])
    else:
        raise SystemExit(f"unknown command {command!r}")
