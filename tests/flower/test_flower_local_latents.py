"""A hierarchical model with client-local latents on Flower: each node's loader declares its
groups with :class:`~numpyro_fed.GroupIndex` (the description that crosses Flower's wire
carries the plate and the count, never an index), and a Flower simulation gives the
in-process deployment's run (the same client functions on the same blocks with the same keys).
"""

import numpy as np
import pytest

import jax

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf

flower = pytest.importorskip("numpyro_fed.flower")
pytest.importorskip("flwr", reason="Flower is not installed (pip install 'numpyro_fed[flower]')")

from numpyro_fed.federation import InProcess  # noqa: E402
from numpyro_fed.federation.base import describe_arguments  # noqa: E402
from numpyro_fed.flower._wire import decode_description, encode_description  # noqa: E402

from runs import assert_same_run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # short runs

M, ROUNDS, KEY = 3, 2, 7
GROUPS = [2, 1, 3]  # groups per node
OWNER = np.repeat(np.arange(M), GROUPS)


def rows(m):
    """Node ``m``'s rows: ``(x, group in the node's numbering, y)``."""
    rng = np.random.default_rng(10 + m)
    group = rng.integers(0, GROUPS[m], size=12)
    x = rng.normal(size=12) * 20.0  # a covariate in raw units
    y = 1.0 + 0.3 * group + 0.05 * x + rng.normal(size=12)
    return x, group, y


ROW_OWNER = np.concatenate([np.full(12, m) for m in range(M)])


def model(x, group, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(2.5))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
    with nf.federated_plate("groups", sum(GROUPS), clients=OWNER):
        a = numpyro.sample("a", dist.Normal(mu, tau))
    with nf.federated_plate("data", x.shape[0], clients=ROW_OWNER):
        numpyro.sample("y", dist.Normal(a[group] + b * x, sigma), obs=y)


def load(node_config):
    m = int(node_config["partition-id"])
    x, group, y = rows(m)
    return x, nf.GroupIndex("groups", group, num_groups=GROUPS[m]), y


def test_a_group_declaration_crosses_the_wire_as_its_plate_and_count():
    described = describe_arguments(load({"partition-id": 2}))
    text = encode_description(described)
    assert "groups" in text and '"shape": [12]' in text
    for value in rows(2)[1]:  # no index value in what the node reports
        assert f"[{value}," not in text.replace(" ", "")
    back = decode_description(text)
    assert isinstance(back[1], nf.GroupIndex)
    assert (back[1].plate, back[1].num_groups) == ("groups", GROUPS[2])
    assert back[1].index == jax.ShapeDtypeStruct((12,), np.int64)


def test_a_flower_simulation_of_a_hierarchical_model_is_the_in_process_deployment(ray_session):
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    make = lambda **kw: nf.DPPVI(model, num_local_steps=3, progress_bar=False, **kw)  # noqa: E731
    local = make(federation=InProcess(loader=lambda m: load({"partition-id": m}), num_clients=M)).run(
        jax.random.PRNGKey(KEY), ROUNDS
    )
    methods = {"dppvi": make()}
    client = flower.client_app(methods, load)
    seen = {}

    from flwr.serverapp import ServerApp

    server = ServerApp()

    @server.main()
    def main(grid, context):
        seen["dppvi"] = flower.run(methods["dppvi"], grid, KEY, ROUNDS, name="dppvi", timeout=120.0)

    flower.simulate(server, client, M)
    assert_same_run(seen["dppvi"], local)
