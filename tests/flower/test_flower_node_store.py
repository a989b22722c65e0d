"""A deployed node's own store of its block and exported functions (numpyro_fed.flower's
``_exported``): a deployed SuperNode starts a new process for every message, and with the
store a message after the node's first of a run neither rebuilds the program nor traces its
function, yet the run is still the in-process run bit for bit; rows that change, even to the
same shapes, are never answered from the stored block.

The nodes here are the ClientApp's handler called directly, every message in a "new
process" (the handler's in-memory cache emptied before each), over a stand-in for Flower's
grid: what a SuperNode does, without Flower's processes."""

import copy
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import jax

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf

flower = pytest.importorskip("numpyro_fed.flower")
flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'numpyro_fed[flower]')")
pytest.importorskip("flatbuffers", reason="jax.export's serialization needs flatbuffers (the flower extra)")

from numpyro_fed.federation import InProcess  # noqa: E402
from numpyro_fed.flower import _node, recipe  # noqa: E402

from runs import assert_same_run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # short runs: convergence warnings

M, ROWS, ROUNDS, KEY = 3, 30, 4, 3


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(2.0))
    with nf.federated_plate("data", X.shape[0], clients=M):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def make_rows(seed):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(M * ROWS, 2)) * np.array([1.0, 50.0])
    y = X @ np.array([0.5, -0.02]) + rng.normal(size=M * ROWS)
    return X, y


class Nodes:
    """A stand-in for Flower's grid: each message goes to the ClientApp's handler of its node,
    in a new process (the in-memory cache emptied); each node keeps its context's state and
    config (its ``jax-cache-dir``) between messages, as a SuperNode does. Counts the messages
    that rebuilt the client program, by call."""

    def __init__(self, methods, cache_dir):
        self.rows = make_rows(0)
        self.handler = _node.NodeHandler(methods, self.load)
        self.contexts = [
            SimpleNamespace(
                node_config={"partition-id": m, "jax-cache-dir": str(cache_dir)}, state=flwr.app.RecordDict()
            )
            for m in range(M)
        ]
        self.rebuilt = []

    def load(self, node_config):
        m = int(node_config["partition-id"])
        X, y = self.rows
        return X[m * ROWS : (m + 1) * ROWS], y[m * ROWS : (m + 1) * ROWS]

    def get_node_ids(self):
        return [100 + m for m in range(M)]

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            node = int(message.metadata.dst_node_id)
            action = message.metadata.message_type.split("numpyro_fed_", 1)[1]
            _node._CACHE.entries.clear()  # a new ClientApp process for every message
            content = message.content["numpyro_fed"]
            self.calling = f"{action}:{content.get('call')}"
            if self.calling == "state:update":  # what the node had when the message came
                self.last_update = (node - 100, message.content, copy.deepcopy(self.contexts[node - 100].state))
            config, arrays = getattr(self.handler, action)(message, self.contexts[node - 100])
            reply = flwr.app.RecordDict()
            if config is not None:
                reply["numpyro_fed"] = flwr.app.ConfigRecord(config)
            if arrays is not None:
                reply["reply"] = flwr.app.ArrayRecord(arrays)
            replies.append(
                SimpleNamespace(metadata=SimpleNamespace(src_node_id=node), has_error=lambda: False, content=reply)
            )
        return replies


def make_nodes(cache_dir, monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp's process has, for its messages
        monkeypatch.setattr(TaskIdentity, name, 1)
    grid = Nodes({"dppvi": nf.DPPVI(model, num_local_steps=5, progress_bar=False)}, cache_dir)
    rebuild = recipe.rebuild_program

    def counting(*args, **kwargs):
        grid.rebuilt.append(grid.calling)
        return rebuild(*args, **kwargs)

    monkeypatch.setattr(recipe, "rebuild_program", counting)
    return grid


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    return make_nodes(tmp_path / "cache", monkeypatch)


def in_process(rows):
    X, y = rows
    loader = lambda m: (X[m * ROWS : (m + 1) * ROWS], y[m * ROWS : (m + 1) * ROWS])  # noqa: E731
    method = nf.DPPVI(model, num_local_steps=5, progress_bar=False, federation=InProcess(loader=loader, num_clients=M))
    return method.run(jax.random.PRNGKey(KEY), ROUNDS)


def test_later_messages_run_the_stored_exported_function_and_give_the_in_process_run(nodes, tmp_path):
    result = flower.run(nodes.handler.methods["dppvi"], nodes, KEY, ROUNDS, name="dppvi")
    assert_same_run(result, in_process(nodes.rows))
    # each node rebuilt the program for "start" and for the first message of each function
    # (the first update, the final loss); the later ROUNDS - 1 updates ran the stored export
    assert [c for c in nodes.rebuilt if c == "state:update"] == ["state:update"] * M, nodes.rebuilt
    stored = os.listdir(tmp_path / "cache" / "numpyro_fed_exported")
    assert sum(f.endswith(".block.npz") for f in stored) == M
    assert sum(f.endswith(".jaxexp") for f in stored) >= M


def test_rows_that_change_to_the_same_shapes_are_not_answered_from_the_stored_block(nodes):
    flower.run(nodes.handler.methods["dppvi"], nodes, KEY, 2, name="dppvi")
    nodes.rows = make_rows(1)  # other rows, the same shapes: the recipe is the same
    nodes.rebuilt.clear()
    result = flower.run(nodes.handler.methods["dppvi"], nodes, KEY, ROUNDS, name="dppvi")
    assert_same_run(result, in_process(nodes.rows))
    assert [c for c in nodes.rebuilt if c == "state:update"] == ["state:update"] * M


def test_a_new_flower_run_never_runs_the_functions_an_earlier_run_stored(nodes, monkeypatch):
    """Within one Flower run the app's code cannot change; across runs it may (the methods'
    settings, the model), with the same recipe: a new run stores its own."""
    from flwr.supercore.task_identity import TaskIdentity

    flower.run(nodes.handler.methods["dppvi"], nodes, KEY, 2, name="dppvi")
    monkeypatch.setattr(TaskIdentity, "_run_id", 2)
    nodes.rebuilt.clear()
    flower.run(nodes.handler.methods["dppvi"], nodes, KEY, 2, name="dppvi")
    assert [c for c in nodes.rebuilt if c == "state:update"] == ["state:update"] * M


def test_a_node_without_a_cache_folder_rebuilds_at_every_message(monkeypatch):
    grid = make_nodes("", monkeypatch)
    result = flower.run(grid.handler.methods["dppvi"], grid, KEY, ROUNDS, name="dppvi")
    assert_same_run(result, in_process(grid.rows))
    assert [c for c in grid.rebuilt if c == "state:update"] == ["state:update"] * (M * ROUNDS)


_FRESH_NODE = """
import pickle, sys
from types import SimpleNamespace
from numpyro_fed.flower import _node

client, content, state, config, rows = pickle.load(open(sys.argv[1], "rb"))
handler = _node.NodeHandler("test_flower_node_store:NEVER_IMPORTED", lambda node_config: rows)
message = SimpleNamespace(content=content, metadata=SimpleNamespace(run_id=1))
reply = handler.state(message, SimpleNamespace(node_config=config, state=state))
heavy = sorted(m for m in sys.modules if m.split(".")[0] == "numpyro" or m.startswith("numpyro_fed.infer"))
pickle.dump((reply, heavy), open(sys.argv[2], "wb"))
"""


def test_a_new_process_answers_an_update_without_importing_numpyro(nodes, tmp_path):
    """What a deployed SuperNode does for each message: a new process, the app's methods named
    by a string (not imported), answers a later round's update from the node's store alone."""
    flower.run(nodes.handler.methods["dppvi"], nodes, KEY, 3, name="dppvi")
    client, content, state = nodes.last_update
    config = nodes.contexts[client].node_config
    expected_state = copy.deepcopy(state)
    expected = nodes.handler.state(
        SimpleNamespace(content=content, metadata=SimpleNamespace(run_id=1)),
        SimpleNamespace(node_config=config, state=expected_state),
    )
    with open(tmp_path / "message.pkl", "wb") as f:
        pickle.dump((client, content, state, config, nodes.load(config)), f)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    code = "import jax; jax.config.update('jax_enable_x64', %r)\n" % bool(jax.config.jax_enable_x64) + _FRESH_NODE
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "message.pkl"), str(tmp_path / "reply.pkl")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    with open(tmp_path / "reply.pkl", "rb") as f:
        (config_reply, arrays), heavy = pickle.load(f)
    assert heavy == []
    assert config_reply == expected[0]
    assert len(arrays) == len(expected[1])
    for a, b in zip(arrays, expected[1]):
        np.testing.assert_array_equal(a, b)


def test_the_store_keeps_the_most_recently_used_runs_only(tmp_path):
    from numpyro_fed.flower._exported import MAX_BLOCKS, ExportStore

    store = ExportStore(tmp_path)
    for run in range(MAX_BLOCKS + 3):
        store.save_block(f"run{run:02d}", [np.full(3, run)])
        store._write(f"run{run:02d}.f.jaxexp", b"{}\n")
        os.utime(tmp_path / f"run{run:02d}.block.npz", (run, run))  # used in this order
        if run == 1:
            first = store.load_block("run01")  # used again: now the most recent
            os.utime(tmp_path / "run01.block.npz", (100, 100))
    store._prune()
    kept = sorted(f.split(".")[0] for f in os.listdir(tmp_path) if f.endswith(".block.npz"))
    assert len(kept) == MAX_BLOCKS and "run01" in kept and "run00" not in kept and "run02" not in kept
    assert sorted(f.split(".")[0] for f in os.listdir(tmp_path) if f.endswith(".jaxexp")) == kept
    np.testing.assert_array_equal(first[0], np.full(3, 1))
