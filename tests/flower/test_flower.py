"""DP-PVI and DSVGD on Flower (numpyro_fed.flower): through Flower's simulation with 3
nodes, each loading its own rows, a run gives the in-process run's answer bit for bit (the
same client functions on the same blocks with the same keys), with the privacy guarantee and
the ledger; no row reaches the server; a node that fails mid-run stops the run with an error
naming it, and the run resumes from the error's state to the uninterrupted answer.

One simulation serves the module (Flower's start-up and the nodes' compiling cost seconds):
its ServerApp runs every case in turn and keeps what it saw."""

import os
import tempfile

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf

flower = pytest.importorskip("numpyro_fed.flower")
pytest.importorskip("flwr", reason="Flower is not installed (pip install 'numpyro_fed[flower]')")

from numpyro_fed.federation import ClientError, InProcess  # noqa: E402
from numpyro_fed.infer import VariationalMethod  # noqa: E402
from numpyro_fed.infer.base import ClientSpec  # noqa: E402

from runs import assert_same_run  # noqa: E402

# Short runs: they check what crosses and that answers agree, not the fits (whose
# convergence warnings they would trigger).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

M, D, ROWS, ROUNDS = 3, 2, 90, 2
SENTINEL = 777.125  # planted in client 1's rows only (exact in float32: found by value in any reply)
KEY = 5


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=M):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def make_data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(ROWS, D))
    y = (X @ np.array([1.0, -1.0]) + rng.logistic(size=ROWS) > 0).astype(float)
    X[ROWS // M, 0] = SENTINEL  # client 1's first row
    return X, y


X, Y = make_data()


def load(node_config):
    """The node's rows: its shard of the data, by its partition-id."""
    m, size = int(node_config["partition-id"]), ROWS // M
    return X[m * size : (m + 1) * size], Y[m * size : (m + 1) * size]


CASES = {
    "dppvi": lambda **kw: nf.DPPVI(model, num_local_steps=5, progress_bar=False, **kw),
    "dppvi-dpsgd": lambda **kw: nf.DPPVI(
        model,
        dp="dpsgd",
        noise_multiplier=1.0,
        sampling="poisson",
        sampling_rate=0.5,
        clip_norm=1.0,
        num_local_steps=5,
        progress_bar=False,
        private_randomness=False,  # reproducible: the run on the nodes is the in-process one
        **kw,
    ),
    "dsvgd": lambda **kw: nf.DSVGD(
        model, num_particles=5, num_local_steps=5, num_distill_steps=5, progress_bar=False, **kw
    ),
}
FAULTY = "dppvi-dpsgd"  # run again, its client 1 failing once in round 2
FAULT_AT = 2  # client 1 fails at its 2nd "update" (round 2 of the sequential schedule)


_REFERENCES = {}


def references(case):
    """The in-process run of ``case`` (deployment: each client loads its rows, as a node)."""
    if case not in _REFERENCES:
        federation = InProcess(loader=lambda m: load({"partition-id": m}), num_clients=M)
        _REFERENCES[case] = CASES[case](federation=federation).run(jax.random.PRNGKey(KEY), ROUNDS)
    return _REFERENCES[case]


class RecordingGrid:
    """The ServerApp's grid, keeping every message the server receives."""

    def __init__(self, grid):
        self.grid = grid
        self.received = []

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.received.extend(replies)
        return replies


def fault_mod(flag):
    """A Flower mod: while the file ``flag`` exists, client 1 raises at its FAULT_AT-th
    "update" call (a plain or a stateful call), once (the flag is then removed)."""

    def mod(msg, context, call_next):
        if (
            os.path.exists(flag)
            and int(context.node_config["partition-id"]) == 1
            and msg.metadata.message_type.endswith(("call", "state"))
            and msg.content["numpyro_fed"]["call"] == "update"
        ):
            with open(flag, "a+") as f:
                f.seek(0)
                seen = len(f.read()) + 1
                f.write("x")
            if seen == FAULT_AT:
                os.remove(flag)
                raise RuntimeError("simulated fault on the node")
        return call_next(msg, context)

    return mod


@pytest.fixture(scope="module")
def simulation(ray_session):
    import sys

    from ray import cloudpickle

    # Flower's workers receive the ClientApp pickled: this module's functions by value (the
    # workers of a Ray started before may not have tests/ on their path)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    seen = {"results": {}, "errors": {}}
    with tempfile.TemporaryDirectory() as folder:
        flag = os.path.join(folder, "fail-once")
        methods = {name: make() for name, make in CASES.items()}
        methods["moments"] = RunningMoments(model, progress_bar=False)
        client = flower.client_app(methods, load, mods=[fault_mod(flag)])

        from flwr.serverapp import ServerApp

        server = ServerApp()

        @server.main()
        def main(grid, context):
            grid = seen["grid"] = RecordingGrid(grid)
            for name in CASES:
                seen["results"][name] = flower.run(methods[name], grid, KEY, ROUNDS, name=name, timeout=120.0)
            seen["results"]["moments"] = flower.run(methods["moments"], grid, KEY, ROUNDS + 1, name="moments")
            open(flag, "w").close()
            try:
                flower.run(methods[FAULTY], grid, KEY, ROUNDS, name=FAULTY, timeout=120.0)
            except ClientError as error:
                seen["errors"][FAULTY] = error
                seen["resumed"] = flower.run(
                    methods[FAULTY], grid, KEY, ROUNDS, name=FAULTY, init_state=error.state, timeout=120.0
                )

        flower.simulate(server, client, M)
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_flower_simulation_gives_the_in_process_run(simulation, case):
    result = simulation["results"][case]
    assert_same_run(result, references(case))
    tree = nf.to_inference_data(result, num_samples=10)
    assert tree.attrs["federation"] == "FlowerFederation"
    assert tree.attrs["num_clients"] == M
    if case == "dppvi-dpsgd":
        assert tree.attrs["privacy_epsilon"] > 0


def test_no_row_reaches_the_server(simulation):
    received = simulation["grid"].received
    assert len(received) > 10
    calls = set()
    for reply in received:
        assert not reply.has_error() or "simulated fault" in reply.error.reason
        if reply.has_error():
            continue
        for record in reply.content.array_records.values():
            for array in record.to_numpy_ndarrays():
                assert not np.isin(SENTINEL, array).any()
                # no block of rows: nothing the size of a client's rows in any reply
                assert array.size < ROWS // M or array.ndim != 2 or array.shape[1] != D
        for record in reply.content.config_records.values():
            assert str(SENTINEL) not in str(dict(record))
            calls.add(record.get("call", None))
    # the server still learned the shapes (the describe replies) and ran every call
    assert any("description" in r.content.config_records.get("numpyro_fed", {}) for r in received if not r.has_error())


def test_a_failed_node_is_named_and_the_run_resumes(simulation):
    error = simulation["errors"][FAULTY]
    assert error.clients == (1,)
    assert "client 1" in str(error) and "Flower node" in str(error) and "simulated fault" in str(error)
    assert error.state.rounds_done == FAULT_AT - 1
    assert_same_run(simulation["resumed"], references(FAULTY), interrupted=True)


def test_samplers_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="round trip.*RayFederation"):
        flower.check_method(nf.FedZigZag(model))
    with pytest.raises(ValueError, match="neighbours.*RayFederation"):
        flower.check_method(nf.DADMMS(model))
    with pytest.raises(TypeError, match="variational"):
        flower.check_method(object())


# -- client state kept by the nodes ---------------------------------------------------------------


class RunningMoments(VariationalMethod):
    """A toy method whose clients keep state: each round the server sends a shift ``c`` and
    every client adds ``sum_rows (y - c)`` and the count of its rows above ``c`` to running
    totals it keeps (its client state), replying the first total. On Flower the totals stay
    in the nodes' ``context.state``: the replies equal the in-process ones only if each node
    found its totals of the previous round."""

    def plan_clients(self, rng_key, args, kwargs, *, num_rounds=None):
        self.build_potential(args, kwargs)
        return ClientSpec({}, stateful={"add": _add_to_totals})

    def init(self, rng_key, *args, num_rounds=None, **kwargs):
        federation = self.start_clients(*self.plan_clients(rng_key, args, kwargs))
        clients = federation.init_state(jnp.zeros((federation.num_clients, 2)))
        return (jnp.zeros(()), clients)

    def update(self, rng_key, state, *args, **kwargs):
        federation = self._active_federation
        shift, clients = state
        with federation.guard():
            clients, total = _step(shift, clients, federation)
        return (shift + 0.25, clients), {"total": total, "version": clients.version}


def _add_to_totals(block, totals, shift):
    y = block["rows"][1]
    valid = block["valid"]["data"]
    new = totals + jnp.stack([jnp.sum(jnp.where(valid, y - shift, 0.0)), jnp.sum(valid & (y > shift))])
    return new, new[0]


@jax.jit
def _step(shift, clients, federation):
    return federation.map("add", shift, state=clients)


def test_the_nodes_keep_their_client_state_between_messages(simulation):
    result = simulation["results"]["moments"]
    federation = InProcess(loader=lambda m: load({"partition-id": m}), num_clients=M)
    local = RunningMoments(model, federation=federation, progress_bar=False).run(jax.random.PRNGKey(KEY), ROUNDS + 1)
    # the totals each node returns accumulate over the rounds as in process: each node found
    # the state it left, in its context.state; the server holds none of it
    np.testing.assert_array_equal(result.metrics["total"], local.metrics["total"])
    np.testing.assert_array_equal(result.metrics["version"], local.metrics["version"])
    assert (np.diff(local.metrics["total"], axis=0) != 0).any()
    assert jax.tree.leaves(result.state[1].values) == []
    assert jax.tree.leaves(local.state[1].values) != []
    np.testing.assert_array_equal(result.ledger["add/bytes_to_client"], local.ledger["add/bytes_to_client"])
    np.testing.assert_array_equal(result.ledger["add/bytes_from_client"], local.ledger["add/bytes_from_client"])


def test_the_client_app_imports_only_what_a_node_needs():
    """A deployed SuperNode starts a new ClientApp process for every message, which imports the
    app: the template's ClientApp names its methods ("fedapp.task:METHODS") and imports its
    loader from a NumPy-only module, so that a message imports neither NumPyro nor any of
    numpyro_fed's algorithms, dp-accounting or SciPy (a node imports them when it rebuilds
    its program, at its first message of a run)."""
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "flower")
    code = (
        "import sys, fedapp.client_app; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpyro', 'dp_accounting', 'scipy', 'optax') "
        "or m.startswith(('numpyro_fed.infer', 'numpyro_fed.potential', 'numpyro_fed.federation', 'fedapp.task'))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(example), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"], out.stdout
