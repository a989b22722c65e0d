"""D-ADMMS at its defaults on the real-model tier: sd and mean of agent 0's draws against the
committed NUTS references (``tests/zoo/references/``), per unconstrained coordinate.

    ZOO_DATA=/work/shared/data python benchmarks/admm_real.py float64 kidiq-m4 earnings-m4 mtcars-m4 wells-m4

Each case runs as the zoo runs it (``tests/zoo/worker.py``: 20 vectorized chains of 100 draws
after 1000 warm-up iterations) and is compared by ``harness.compare_real``; the run's warnings
are printed below it.
"""

import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main(dtype, cases):
    if dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    from zoo import harness, worker

    for case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "run.json")
            start = time.time()
            worker.run(case, "DADMMS", dtype, out)
            with open(out) as f:
                record = json.load(f)
        if record["status"] != "completed":
            print(case, dtype, "error:", record["error"]["message"][:300], flush=True)
            continue
        ref = harness.real_reference(case.rsplit("-", 1)[0])
        summary = record["summary"]
        agrees, _ = harness.compare_real(summary, ref, "DADMMS")
        ratios = np.asarray(summary["sd"]) / ref["sd"]
        offsets = (np.asarray(summary["mean"]) - ref["mean"]) / ref["sd"]
        print(
            f"{case} {dtype} {time.time() - start:.0f} s agrees={agrees} sd ratios {np.round(ratios, 2).tolist()} "
            f"mean offsets (ref sd) {np.round(offsets, 2).tolist()}",
            flush=True,
        )
        for w in record["warnings"]:
            print("   warning:", w["message"][:300], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
