import os
import sys

import numpyro

# Correctness tests run in float64 (the split must match NumPyro to round-off).
numpyro.enable_x64()
sys.path.insert(0, os.path.dirname(__file__))

SHARED_DATA = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "shared", "data")
