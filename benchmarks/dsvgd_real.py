"""DSVGD on the zoo's real tier, in this process, with settings to compare against its defaults.

Runs ``nf.DSVGD(model, **options).run(key, max(10, 2 M), *args)`` on one real-tier case (as
``tests/zoo/worker.py`` does), draws 2000 particles' worth of samples and compares every
unconstrained coordinate with the case's NUTS reference (``tests/zoo/references``) under the
tier's targets: every mean within 0.3 reference sd, every sd ratio within [1/1.5, 1.5].
Prints the worst mean offset, the worst sd ratio, the moment correction's residual (the
fraction of the score's variance a linear fit leaves; see ``stein.moments``), whether DSVGD
warned, and the seconds.

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/dsvgd_real.py ships-m4 --dtype float64
    ZOO_DATA=../shared/data PYTHONPATH=$PWD:$PWD/tests python benchmarks/dsvgd_real.py adult-m4 kin8nm-m4

(the UCI cases need their data: ``ZOO_DATA``, see ``tests/zoo/real_models.py``).
    PYTHONPATH=$PWD:$PWD/tests python benchmarks/dsvgd_real.py wells-m4 --dtype float32 --option num_local_steps=400
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
import warnings

import numpy as np

if "float64" in sys.argv:
    import numpyro

    numpyro.enable_x64()

import jax  # noqa: E402

import numpyro_fed as nf  # noqa: E402

from zoo import harness, worker  # noqa: E402
from zoo.models import get_case  # noqa: E402


def run(case_name, dtype, options, seed=0):
    case = get_case(case_name)
    model, args = case.build()
    args = worker._cast(args, dtype)
    supports = worker.latent_sites(model, args)
    ref = harness.reference(case_name)
    run_key, draw_key = jax.random.split(jax.random.PRNGKey(seed))
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        method = nf.DSVGD(model, progress_bar=False, **options)
        try:
            result = method.run(run_key, max(10, 2 * case.num_clients), *args)
            draws = method.get_samples(draw_key, result, 2000)
        except Exception as exc:  # noqa: BLE001 (reported, not raised)
            return f"{type(exc).__name__}: {str(exc)[:200]}", time.perf_counter() - start
    seconds = time.perf_counter() - start
    residual = result.metrics.get("moment_residual")
    residual = "" if residual is None else f" (moment correction's residual {float(residual[-1]):.3g})"
    summary = worker.summarise({k: np.asarray(draws[k])[None] for k in supports}, supports)
    warned = [
        str(w.message)[:160] for w in caught if issubclass(w.category, RuntimeWarning) and "DSVGD" in str(w.message)
    ]
    if summary.get("num_nonfinite"):
        return f"non-finite draws ({summary['num_nonfinite']}); warned={bool(warned)}", seconds
    mean, sd = np.asarray(summary["mean"]), np.asarray(summary["sd"])
    mean_err = np.abs(mean - ref["mean"]) / ref["sd"]
    ratio = sd / ref["sd"]
    worst = int(np.abs(np.log(ratio)).argmax())
    agrees = mean_err.max() <= 0.3 and np.abs(np.log(ratio)).max() <= np.log(1.5)
    names = summary["coordinates"]
    verdict = "agrees" if agrees and not warned else ("warns" if warned else "WRONG (no warning)")
    if agrees and warned:
        verdict = "agrees but warns"
    return (
        f"{verdict}: worst mean {names[int(mean_err.argmax())]} {mean_err.max():.2f} sd, "
        f"worst sd ratio {names[worst]} {ratio[worst]:.3g}{residual}" + (f" | {warned[0]}" if warned else "")
    ), seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    parser.add_argument("--option", action="append", default=[], help="name=value passed to nf.DSVGD")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    options = {}
    for item in a.option:
        name, value = item.split("=", 1)
        options[name] = ast.literal_eval(value)
    for case_name in a.cases:
        line, seconds = run(case_name, a.dtype, options, a.seed)
        print(f"{case_name} {a.dtype} {options or 'defaults'}: {line} [{seconds:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
