"""The README's example runs as written and says what it claims."""

import os
import re

import numpy as np
import pytest

import jax.numpy as jnp

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def test_readme_example_runs_and_the_split_matches_numpyro():
    text = open(README).read()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    fp, z, mcmc, idata = (namespace[k] for k in ("fp", "z", "mcmc", "idata"))

    import jax

    from numpyro.infer.util import initialize_model

    reference = initialize_model(
        jax.random.PRNGKey(0), namespace["model"], model_args=(namespace["X"], namespace["y"])
    ).potential_fn(z)
    assert fp.client_potentials(z).shape == (4,)
    assert jnp.allclose(fp.potential(z), reference, rtol=1e-6)
    assert idata.posterior["w"].shape == (1, 500, 3)
    assert idata.attrs["num_clients"] == 4
    # y = 1{X[:, 0] > 0}: the first coefficient is clearly positive
    assert float(mcmc.get_samples()["w"][:, 0].mean()) > 1.0

    # FedZigZag and NUTS agree on the posterior means within both chains' Monte Carlo errors
    from numpyro.diagnostics import effective_sample_size

    fed, fed_idata = namespace["fed"], namespace["fed_idata"]
    assert fed_idata.sample_stats["events_by_client"].shape == (1, 1000, 4)
    a, b = np.asarray(fed.get_samples()["w"]), np.asarray(mcmc.get_samples()["w"])
    error = np.sqrt(a.var(0) / effective_sample_size(a[None]) + b.var(0) / effective_sample_size(b[None]))
    assert np.all(np.abs(a.mean(0) - b.mean(0)) < 5 * error)


@pytest.mark.slow
def test_readme_example_runs_without_a_warning_in_float32():
    # NumPyro's default dtype is float32 (the tests enable float64), so the example runs in a
    # fresh interpreter, every warning an error. The FedZigZag mode search makes one BFGS run
    # (it used to restart 20 times and warn that the MAP was not a mode), and FedZigZag and
    # NUTS agree within 5 Monte Carlo errors of the difference of the means.
    import json
    import subprocess
    import sys

    text = open(README).read()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1) + (
        "\nimport json, numpy as np\n"
        "from numpyro.diagnostics import effective_sample_size\n"
        "a, b = np.asarray(fed.get_samples()['w']), np.asarray(mcmc.get_samples()['w'])\n"
        "error = np.sqrt(a.var(0) / effective_sample_size(a[None]) + b.var(0) / effective_sample_size(b[None]))\n"
        "print(json.dumps({'z': (np.abs(a.mean(0) - b.mean(0)) / error).tolist(), 'dtype': str(a.dtype),\n"
        "                  'attempts': fed.sampler.mode_search.attempts}))\n"
    )
    env = dict(
        os.environ, JAX_ENABLE_X64="0", PYTHONPATH=os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], env=env, capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "float32" and result["attempts"] == 1
    assert max(result["z"]) < 5, result
