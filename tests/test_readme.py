"""The README's example runs as written and says what it claims."""

import os
import re

import jax.numpy as jnp
import numpy as np

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def test_readme_example_runs_and_the_split_matches_numpyro():
    text = open(README).read()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    fp, z, mcmc, idata = (namespace[k] for k in ("fp", "z", "mcmc", "idata"))

    from numpyro.infer.util import initialize_model
    import jax

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
