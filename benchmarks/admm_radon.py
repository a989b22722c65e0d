"""D-ADMMS on radon-m4 (Gelman & Hill's radon, a centred hierarchy without a mode): agent 0's
draws against the committed NUTS reference (``tests/zoo/references/radon.json``), per
unconstrained coordinate, and where the iterates first stop being finite.

    python benchmarks/admm_radon.py default       # rho="auto" (20 chains x 100 draws after 1000)
    python benchmarks/admm_radon.py paper 0 150   # rho=5: first non-finite iteration per chain
    python benchmarks/admm_radon.py noncentred    # the model through LocScaleReparam(0)

(float64; ``default`` and ``noncentred`` as the zoo runs DADMMS on the real tier, see
``docs/guide/dadmms.md``, "Models without a mode".)
"""

import json
import os
import sys
import time
import warnings

import numpy as np

import jax

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from numpyro.handlers import reparam  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402
from numpyro.infer.reparam import LocScaleReparam  # noqa: E402

import numpyro_fed as nf  # noqa: E402

from zoo.real_models import MODELS  # noqa: E402


def main(variant, warmup=1000, samples=100):
    model, args = MODELS["radon"].build(4)
    kwargs = {"rho": 5.0} if variant == "paper" else {}
    if variant == "noncentred":
        model = reparam(model, config={"a": LocScaleReparam(centered=0)})
    kernel = nf.DADMMS(model, **kwargs)
    mcmc = MCMC(
        kernel, num_warmup=warmup, num_samples=samples, num_chains=20, chain_method="vectorized", progress_bar=False
    )
    start = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(jax.random.PRNGKey(0), *args)
    print(
        f"{variant}: {time.time() - start:.0f} s, rho {kernel.rho_used:g}, noise_scale {kernel.noise_scale_used:.3g}, "
        f"scaling {'none' if kernel.scaling is None else ('mode' if kernel.scaling.mode else 'surrogate')}"
    )
    for w in caught:
        print("  warning:", str(w.message)[:400])
    draws = nf.DADMMS.agent_draws(mcmc, 0, group_by_chain=True)
    if "a" not in draws:
        draws["a"] = draws["mu_a"][..., None] + draws["sigma_a"][..., None] * draws["a_decentered"]
    columns = [draws["mu_a"], np.log(draws["sigma_a"]), draws["b"], np.log(draws["sigma_y"])]
    x = np.concatenate([np.asarray(c, np.float64)[..., None] for c in columns] + [np.asarray(draws["a"])], -1)
    finite = np.isfinite(x).all(-1)  # (chains, draws)
    if not finite.all():
        first = [int(np.argmin(f)) if not f.all() else -1 for f in finite]
        print("  first non-finite draw per chain (after warm-up):", first)
        return
    ref = json.load(open(os.path.join("tests", "zoo", "references", "radon.json")))["summary"]
    names, ref_mean, ref_sd = ref["coordinates"], np.array(ref["mean"]), np.array(ref["sd"])
    flat = x.reshape(-1, x.shape[-1])
    error, ratio = np.abs(flat.mean(0) - ref_mean) / ref_sd, flat.std(0) / ref_sd
    for j in range(4):
        print(f"  {names[j]}: {error[j]:.2f} reference sd off, sd ratio {ratio[j]:.3f}")
    inside = (ratio <= 1.4) & (ratio >= 1 / 1.4)
    print(
        f"  all 89: sd ratio {ratio.min():.3f}-{ratio.max():.3f} (median {np.median(ratio):.3f}, {inside.sum()} within "
        f"1.4), worst mean {names[error.argmax()]} {error.max():.2f} sd, {(error <= 0.3).sum()} within 0.3 sd"
    )


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
