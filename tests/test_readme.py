"""The README's example runs as written and says what it claims."""

import os
import re

import jax.numpy as jnp

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
