"""FedZigZag's two ways to thin, side by side: min-ESS per CPU second (process time, less
sensitive than wall time to other processes on a loaded machine; compilation included).

Logistic regression, d = 6, 4 clients x 250 rows (``_federation_zigzag``'s model),
``sample_interval=0.5``, 200 warmup + 4000 draws, float64. ``default`` is
``FedZigZag(model)`` (in process: the server thins the superposed proposals), ``clients`` is
``thinning="clients"`` (every client thins its own, the protocol an engine runs).

    .venv/bin/python benchmarks/zigzag_thinning.py default clients default clients

Run it from two checkouts, interleaved, to compare a change's speed.
"""

import os
import sys
import time
import warnings

import numpy as np

import jax

import numpyro
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC

import numpyro_fed as nf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _federation_zigzag as fz  # noqa: E402

numpyro.enable_x64()
M = 4


def measure(name: str) -> dict:
    X, y = fz.make_data(M)
    options = {} if name == "default" else {"thinning": name}
    mcmc = MCMC(
        nf.FedZigZag(fz.logistic, sample_interval=0.5, **options), num_warmup=200, num_samples=4000, progress_bar=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        mcmc.run(jax.random.PRNGKey(0), X, y, clients=M)
        jax.block_until_ready(mcmc.get_samples())
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    ess = float(np.min(effective_sample_size(np.asarray(mcmc.get_samples(group_by_chain=True)["w"]))))
    return {"min_ess": ess, "cpu_s": cpu, "wall_s": wall, "ess_per_cpu_s": ess / cpu}


if __name__ == "__main__":
    for name in sys.argv[1:] or ["default", "clients"]:
        r = measure(name)
        print(
            f"{name:8s} min-ESS {r['min_ess']:.0f}  cpu {r['cpu_s']:.1f} s  wall {r['wall_s']:.1f} s  "
            f"min-ESS per CPU second {r['ess_per_cpu_s']:.1f}",
            flush=True,
        )
