"""Computes the NUTS references of the zoo's real-model tier (``tests/zoo/references/*.json``).

NumPyro NUTS on each pooled model (:mod:`zoo.real_models`) in float64: 4 chains of
``--warmup`` + ``--samples`` draws. A reference is written only if every flat unconstrained
coordinate has split R-hat below 1.01 and a bulk ESS of at least 1000 (so its own Monte Carlo
error, at most 0.03 posterior sd on a mean, is small beside the tier's tolerances); otherwise
the script says which and writes nothing for that model. The JSON holds, per coordinate, the
mean, sd, ESS of the draws and of their squared deviations, kurtosis and R-hat, and a
fingerprint of the model's code and data that the tier checks before using it.

    ZOO_DATA=../shared/data .venv/bin/python tools/zoo_real_references.py            # every model
    .venv/bin/python tools/zoo_real_references.py --model radon --model kidiq
"""

import os

os.environ["JAX_ENABLE_X64"] = "1"  # before JAX is imported
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import jax  # noqa: E402

from numpyro.diagnostics import split_gelman_rubin  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402

from zoo import real_models  # noqa: E402
from zoo.harness import real_fingerprint  # noqa: E402
from zoo.worker import _cast, latent_sites, summarise  # noqa: E402

MAX_RHAT = 1.01
MIN_ESS = 1000


def _flat_unconstrained(draws, supports):
    """``(chains, draws, D)`` of the flat unconstrained coordinates (for R-hat)."""
    import jax.numpy as jnp

    from numpyro.distributions.transforms import biject_to

    columns = []
    for name, support in supports.items():
        u = np.asarray(biject_to(support).inv(jnp.asarray(draws[name])), dtype=np.float64)
        columns.append(u.reshape(u.shape[0], u.shape[1], -1))
    return np.concatenate(columns, -1)


def _describe(value):
    """A NUTS setting as JSON: itself, or ``init_to_median(num_samples=15)`` for an init strategy."""
    if isinstance(value, (bool, int, float, str)):
        return value
    func, keywords = getattr(value, "func", value), getattr(value, "keywords", {})
    return f"{func.__name__}(" + ", ".join(f"{k}={v!r}" for k, v in keywords.items()) + ")"


def compute(name, warmup, samples, target_accept):
    model_spec = real_models.MODELS[name]
    model, args = model_spec.pooled()
    args = _cast(args, np.float64)
    supports = latent_sites(*model_spec.build(1)[:1], args)
    start = time.perf_counter()
    mcmc = MCMC(
        NUTS(model, **{"target_accept_prob": target_accept, **model_spec.nuts}),
        num_warmup=warmup,
        num_samples=samples,
        num_chains=4,
        chain_method="sequential",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(2024), *args)
    seconds = time.perf_counter() - start
    draws = {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    summary = summarise(draws, supports)
    rhat = np.asarray(split_gelman_rubin(_flat_unconstrained(draws, supports)))
    divergences = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
    ess = np.asarray(summary["ess_mean"])
    record = {
        "model": name,
        "source": model_spec.source,
        "fingerprint": real_fingerprint(name),
        "nuts": {
            "num_warmup": warmup,
            "num_samples": samples,
            "num_chains": 4,
            "target_accept_prob": target_accept,
            **{k: _describe(v) for k, v in model_spec.nuts.items()},
        },
        "seconds": round(seconds, 1),
        "divergences": divergences,
        "max_rhat": float(rhat.max()),
        "min_ess": float(ess.min()),
        "rhat": rhat.tolist(),
        "summary": summary,
    }
    ok = rhat.max() < MAX_RHAT and ess.min() >= MIN_ESS and divergences == 0
    print(
        f"{name}: {len(ess)} coordinates, max R-hat {rhat.max():.4f}, min ESS {ess.min():.0f}, "
        f"{divergences} divergences, {seconds:.0f} s: {'written' if ok else 'NOT written'}",
        flush=True,
    )
    if ok:
        with open(model_spec.reference_path(), "w") as f:
            json.dump(record, f, indent=0)
            f.write("\n")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", choices=sorted(real_models.MODELS))
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--target-accept", type=float, default=0.9)
    args = parser.parse_args()
    os.makedirs(real_models.REFERENCES_DIR, exist_ok=True)
    results = [compute(m, args.warmup, args.samples, args.target_accept) for m in args.model or real_models.MODELS]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
