"""The federation seam: InProcess and RayFederation agree, the ledger counts what crosses the
wire, faults name the client, and no client's function holds another client's rows."""

import contextlib
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.federation import ClientError, ClientProgram, InProcess, MessageLedger

from helpers import SENTINEL, holds_sentinel, holds_value, save_client_rows

M, R, D = 3, 4, 2


def toy_blocks():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(R, D)), "w": np.full(R, 1.0 + m)} for m in range(M)]


def weighted_sum(block, theta):
    return jnp.sum(block["w"][:, None] * jnp.tanh(block["x"] * theta), axis=0)


def scaled(block, theta, own):
    return weighted_sum(block, theta) * own


def _sleep_host(seconds):
    time.sleep(float(seconds))
    return np.asarray(seconds)


def nap(block, seconds):
    """Sleeps ``seconds`` on the worker (a hung client when long)."""
    return jax.pure_callback(_sleep_host, jax.ShapeDtypeStruct((), seconds.dtype), seconds)


FUNCTIONS = {"sum": weighted_sum, "scaled": scaled, "nap": nap}


def toy_program(blocks=None):
    return ClientProgram(FUNCTIONS, blocks=blocks or toy_blocks())


def reference_map(theta, own=None):
    blocks = toy_blocks()
    if own is None:
        return jnp.stack([weighted_sum(b, theta) for b in blocks])
    return jnp.stack([scaled(b, theta, own[m]) for m, b in enumerate(blocks)])


def test_inprocess_map_and_one_inside_jit_and_vmap_equal_plain_computation():
    fed = InProcess().start(toy_program())
    theta = jnp.array([0.3, -0.7])
    own = jnp.arange(1.0, M + 1)

    np.testing.assert_allclose(jax.jit(lambda f, t: f.map("sum", t))(fed, theta), reference_map(theta), rtol=1e-13)
    np.testing.assert_allclose(
        jax.jit(lambda f, t, o: f.map("scaled", t, per_client=(o,)))(fed, theta, own),
        reference_map(theta, own),
        rtol=1e-13,
    )
    # vmap over chains: each chain its own theta and own client.
    thetas = jnp.stack([theta, 2 * theta, -theta])
    clients = jnp.array([2, 0, 1])
    chains = jax.jit(jax.vmap(lambda t, c: fed.one("sum", c, t)))(thetas, clients)
    for k in range(3):
        np.testing.assert_allclose(chains[k], reference_map(thetas[k])[clients[k]], rtol=1e-13)

    # inside a while loop, closed over rather than passed
    def body(carry):
        i, acc = carry
        return i + 1, acc + fed.map("sum", theta).sum()

    _, total = jax.jit(lambda: lax.while_loop(lambda c: c[0] < 3, body, (0, 0.0)))()
    np.testing.assert_allclose(total, 3 * reference_map(theta).sum(), rtol=1e-12)


def test_inprocess_ledger_derives_bytes_from_shapes():
    fed = InProcess().start(toy_program())
    theta = jnp.zeros(D)
    jax.jit(lambda f, t, o: f.map("scaled", t, per_client=(o,)))(fed, theta, jnp.ones(M))
    one = jax.jit(lambda f, c: f.one("sum", c, theta))
    one(fed, 1)
    one(fed, 1)
    # a vmap over 3 chains whose requests differ: one message per chain
    jax.jit(jax.vmap(lambda f, t: f.map("scaled", t, per_client=(jnp.ones(M),)), in_axes=(None, 0)))(
        fed, jnp.zeros((3, D))
    )
    # the calls a caller counts itself are not counted
    with fed.counted_by_caller():
        jax.jit(lambda f: f.map("scaled", theta, per_client=(jnp.ones(M),)))(fed)
    s = fed.ledger.summary()
    itemsize = theta.dtype.itemsize
    # the seam counts every call it carries when it runs: 1 + 3 "scaled", 2 "sum" to client 1
    np.testing.assert_array_equal(s["scaled/bytes_to_client"], 4 * (D + 1) * itemsize)
    np.testing.assert_array_equal(s["scaled/bytes_from_client"], 4 * D * itemsize)
    np.testing.assert_array_equal(s["sum/messages_to_client"], [0, 2, 0])
    np.testing.assert_array_equal(s["rounds"], [4, 6, 4])


def test_inprocess_agent_network_runs_the_agents_against_their_neighbours_only():
    from typing import NamedTuple

    from numpyro_fed.federation.decentralized import AgentProgram

    class Own(NamedTuple):
        x: jax.Array

    def send(local, key, own, inbox, mask):  # diffusion on the graph: what the neighbours sent only
        new = own.x + local * (inbox.sum(0) - mask.sum() * own.x)
        return new, new

    def receive(local, new, inbox, previous_inbox, mask):
        return Own(new), ()

    adjacency = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], bool)
    program = AgentProgram(lambda own: own.x, send, receive, local=jnp.full(M, 0.1))
    network = InProcess().agent_network(program, adjacency)
    step = jax.jit(network.step)
    state = network.start(Own(jnp.array([[1.0], [0.0], [4.0]])))
    for t in range(20):
        state, _ = step(jax.random.PRNGKey(0), t, state)
    x = np.array([[1.0], [0.0], [4.0]])
    for _ in range(20):
        x = x + 0.1 * (adjacency.T.astype(float) @ x - adjacency.sum(0)[:, None] * x)
    np.testing.assert_allclose(state.own.x, x, rtol=1e-12)
    assert InProcess.runs_agents


def test_bad_blocks_are_refused_naming_the_client():
    blocks = toy_blocks()
    blocks[2]["x"][1, 0] = np.nan
    with pytest.raises(ValueError, match="client 2.*non-finite"):
        InProcess().start(toy_program(blocks))
    blocks = toy_blocks()
    blocks[1]["x"] = blocks[1]["x"][:, :1]
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), toy_blocks()[0])
    with pytest.raises(ValueError, match=r"client 1: \['x'\] has shape"):
        InProcess().start(ClientProgram(FUNCTIONS, blocks=blocks, spec=spec))
    with pytest.raises(ValueError, match="exactly one of blocks"):
        ClientProgram(FUNCTIONS)
    with pytest.raises(ValueError, match=r"timeouts name \['napp'\]"):
        ClientProgram(FUNCTIONS, blocks=toy_blocks(), timeouts={"napp": 10.0})
    with pytest.raises(ValueError, match="timeout of 'nap' must be a finite number > 0"):
        ClientProgram(FUNCTIONS, blocks=toy_blocks(), timeouts={"nap": 0})


def test_ledger_adds_per_client_and_direction():
    ledger = MessageLedger(3)
    ledger.add("x", "to_client", [0, 0, 2], messages=1, nbytes=4, rounds=1)
    s = ledger.summary()
    assert s["messages_to_client"].tolist() == [2, 0, 1]
    assert s["x/bytes_to_client"].tolist() == [8, 0, 4]
    assert s["rounds"].tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="direction"):
        ledger.add("x", "sideways", 0)
    assert issubclass(ClientError, RuntimeError)


# -- Ray --------------------------------------------------------------------------------------


@pytest.fixture
def ray_pair(ray_federation):
    return ray_federation.start(toy_program()), InProcess().start(toy_program())


def run_toy_calls(fed):
    """The same calls on any backend: map and one, inside jit, vmap over chains, while_loop."""
    theta = jnp.array([0.3, -0.7])
    thetas = jnp.stack([theta, 2 * theta, -theta])
    own = jnp.arange(1.0, M + 1)
    with fed.guard():
        out = {
            "map": jax.jit(lambda f, t: f.map("sum", t))(fed, theta),  # passed, not closed over
            "map_chains": jax.jit(jax.vmap(lambda t, o: fed.map("scaled", t, per_client=(o,))))(
                thetas, own * jnp.arange(1.0, 4.0)[:, None]
            ),
            "one": jax.jit(lambda c: fed.one("scaled", c, theta, own=(own,)))(2),
            "one_chains": jax.jit(jax.vmap(lambda t, c: fed.one("sum", c, t)))(thetas, jnp.array([2, 0, 2])),
            "loop": jax.jit(
                lambda: lax.fori_loop(0, 2, lambda i, a: a + fed.map("sum", theta * i), jnp.zeros((M, D)))
            )(),
        }
    return out


def test_ray_gives_bit_identical_answers_to_inprocess(ray_pair):
    ray_fed, local = ray_pair
    ray_fed.ledger.reset()
    on_ray, in_process = run_toy_calls(ray_fed), run_toy_calls(local)
    for key in in_process:
        for a, b in zip(jax.tree.leaves(on_ray[key]), jax.tree.leaves(in_process[key])):
            assert a.shape == b.shape and a.dtype == b.dtype, key
            np.testing.assert_array_equal(a, b, err_msg=key)
    # one round trip per call (all chains together), none per chain
    assert ray_fed.ledger.round_trips == 6


def test_small_and_large_ray_calls_give_the_same_answers_and_the_clients_time_their_work(ray_pair):
    """Small calls travel as one pickled buffer each way, larger ones (``pack_limit``) through
    Ray's own serialization: the same answers; each client counts its calls and their time."""
    ray_fed, local = ray_pair
    before = ray_fed.compute_time()
    limit = ray_fed.pack_limit
    packed = run_toy_calls(ray_fed)
    ray_fed.pack_limit = 0  # every call through Ray's serialization
    try:
        plain = run_toy_calls(ray_fed)
    finally:
        ray_fed.pack_limit = limit
    in_process = run_toy_calls(local)
    for key in in_process:
        for a, b, c in zip(jax.tree.leaves(packed[key]), jax.tree.leaves(plain[key]), jax.tree.leaves(in_process[key])):
            np.testing.assert_array_equal(a, c, err_msg=key)
            np.testing.assert_array_equal(b, c, err_msg=key)
    after = ray_fed.compute_time()
    # "sum" per run: "map" and "loop" (2 maps) on every client, "one_chains" on clients 2 and 0
    calls = [after[m]["sum"][0] - before[m].get("sum", (0, 0.0))[0] for m in range(M)]
    assert calls == [2 * 4, 2 * 3, 2 * 4]
    assert all(after[m]["sum"][1] > before[m].get("sum", (0, 0.0))[1] for m in range(M))


def test_ray_ledger_counts_the_payloads_and_agrees_with_the_inprocess_ledger(ray_pair):
    ray_fed, local = ray_pair
    ray_fed.ledger.reset()
    local.ledger.reset()
    run_toy_calls(ray_fed)
    run_toy_calls(local)
    # both count what crossed: the engine from its payloads, InProcess from its calls as they run
    ray_summary, local_summary = ray_fed.ledger.summary(), local.ledger.summary()
    assert ray_summary.keys() == local_summary.keys()
    for key in ray_summary:
        np.testing.assert_array_equal(ray_summary[key], local_summary[key], err_msg=key)
    # the payloads: per chain, theta (D floats) and the client's own factor, both ways
    itemsize = jnp.zeros(()).dtype.itemsize
    assert ray_summary["scaled/bytes_to_client"].tolist() == [3 * (D + 1) * itemsize] * 2 + [4 * (D + 1) * itemsize]


def test_a_hung_client_raises_client_error_naming_it_within_the_timeout(ray_session):
    from numpyro_fed import RayFederation

    with RayFederation(timeout=1.0).start(ClientProgram(FUNCTIONS, blocks=toy_blocks()[:2])) as fed:
        naps = jax.jit(lambda s: fed.map("nap", per_client=(s,)))
        with fed.guard():
            np.testing.assert_array_equal(naps(jnp.zeros(2)), np.zeros(2))
        start = time.monotonic()
        with pytest.raises(ClientError, match=r"call 'nap'.*client\(s\) \[1\] did not answer") as info:
            with fed.guard():
                naps(jnp.array([0.0, 3.0])).block_until_ready()
        assert time.monotonic() - start < 6.0 and info.value.clients == (1,)

        import ray

        ray.kill(fed.actors[0])
        start = time.monotonic()
        with pytest.raises(ClientError, match="client 0 died") as info:
            with fed.guard():
                jax.jit(lambda t: fed.map("sum", t))(jnp.ones(D)).block_until_ready()
        # (client 1 may still be asleep, and be named too)
        assert time.monotonic() - start < 6.0 and info.value.clients[0] == 0 and info.value.call == "sum"

        # a new worker for the dead client, with the same block: the run can go on
        fed.restart([0])
        with fed.guard():
            np.testing.assert_allclose(
                jax.jit(lambda t: fed.map("sum", t))(jnp.ones(D)),
                jnp.stack([weighted_sum(b, jnp.ones(D)) for b in toy_blocks()[:2]]),
                rtol=1e-13,
            )


def test_a_call_the_program_gives_a_timeout_may_take_longer_than_the_federation_s(ray_session):
    # a function whose one call is a client's whole run (ConsensusMC's MCMC) gets its own timeout
    from numpyro_fed import RayFederation

    program = ClientProgram(FUNCTIONS, blocks=toy_blocks()[:2], timeouts={"nap": 8.0})
    with RayFederation(timeout=0.5).start(program) as fed:
        naps = jax.jit(lambda s: fed.map("nap", per_client=(s,)))
        with fed.guard():
            np.testing.assert_array_equal(naps(jnp.zeros(2)), np.zeros(2))  # compiles on the workers
            np.testing.assert_array_equal(naps(jnp.array([0.0, 2.0])), [0.0, 2.0])  # 2 s > 0.5 s: answered
        with pytest.raises(ClientError, match=r"call 'nap'.*client\(s\) \[1\] did not answer within 8.0 s"):
            with fed.guard():
                naps(jnp.array([0.0, 20.0])).block_until_ready()


def test_deployment_loaders_run_on_the_workers_and_bad_data_is_refused(ray_federation, tmp_path):
    blocks = toy_blocks()
    sentinel = 1234.5678
    blocks[1]["x"][0, 0] = sentinel
    for m, block in enumerate(blocks):
        np.save(tmp_path / f"x{m}.npy", block["x"])
        np.save(tmp_path / f"w{m}.npy", block["w"])
    folder = str(tmp_path)

    def loader(m):
        return {"x": np.load(f"{folder}/x{m}.npy"), "w": np.load(f"{folder}/w{m}.npy")}

    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), blocks[0])
    program = ClientProgram(FUNCTIONS, loader=loader, num_clients=M, spec=spec)
    fed = ray_federation.start(program)
    got = jax.jit(lambda t: fed.map("sum", t))(jnp.array([0.3, -0.7]))
    want = jnp.stack([weighted_sum(b, jnp.array([0.3, -0.7])) for b in blocks])
    np.testing.assert_allclose(got, want, rtol=1e-14)
    # the driver holds shapes, never rows
    assert fed.block_specs[1]["x"].shape == (R, D)
    assert not holds_value(sentinel, fed.block_specs, fed.ledger.summary(), program)

    x1 = blocks[1]["x"].copy()
    x1[2, 1] = np.nan
    np.save(tmp_path / "x1.npy", x1)
    np.save(tmp_path / "x2.npy", np.zeros((R, D + 1)))
    with pytest.raises(ValueError, match=r"client 1: \['x'\] holds non-finite.*client 2: \['x'\] has shape \(4, 3\)"):
        fed.start(program)


# -- client-side potentials --------------------------------------------------------------------

import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402

import numpyro_fed as nf  # noqa: E402

COUNTS = [5, 7, 4]
OWNER = np.repeat(np.arange(len(COUNTS)), COUNTS)


def logistic(X, y=None, clients=len(COUNTS)):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.HalfNormal(1.0))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def pooled_rows():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(sum(COUNTS), 2))
    X[COUNTS[0], 0] = SENTINEL  # client 1's first row
    return X, (rng.random(sum(COUNTS)) < 0.5) * 1.0


def save_per_client(tmp_path):
    return save_client_rows(tmp_path, np.cumsum([0] + COUNTS), *pooled_rows())


def potential_program(fp):
    client_potential = fp.client_potential_fn
    return fp.client_program(
        {
            "value": lambda block, z: client_potential(z, block),
            "grad": lambda block, z: jax.grad(client_potential)(z, block),
        }
    )


def test_no_client_function_holds_another_clients_rows():
    X, y = pooled_rows()
    fp = nf.split_potential(logistic, (X, y), {"clients": OWNER})
    assert holds_sentinel(fp.client_block(1))  # the check sees rows when they are there
    flat = fp.flat()
    assert not holds_sentinel(
        fp.client_potential_fn,
        fp.row_log_likelihood_fn,
        fp.client_block(0),
        fp.client_block(2),
        flat.client_potential,
        flat.row_log_likelihood,
    )
    assert not holds_sentinel(
        fp.prior_potential_fn, fp.postprocess_fn, fp.init_params, flat.prior_potential, flat.postprocess
    )
    program = potential_program(fp)
    assert not holds_sentinel(program.functions, program.blocks[0], program.blocks[2])


def test_deployment_with_loaders_matches_simulation_bit_for_bit(tmp_path):
    X, y = pooled_rows()
    simulated = nf.split_potential(logistic, (X, y), {"clients": OWNER})
    deployed = nf.split_potential(logistic, loader=save_per_client(tmp_path), num_clients=3)
    assert deployed.deployed and deployed.client_data is None
    assert deployed.client_sizes.tolist() == COUNTS
    z = deployed.init_params
    fed = InProcess().start(potential_program(deployed))
    values = jax.jit(lambda f, z: f.map("value", z))(fed, z)
    np.testing.assert_array_equal(values, simulated.client_potentials(z))
    np.testing.assert_array_equal(deployed.prior_potential(z), simulated.prior_potential(z))
    for k, v in deployed.postprocess_fn(z).items():
        np.testing.assert_array_equal(v, simulated.postprocess_fn(z)[k])
    # the server's objects hold no row of any client
    assert not holds_sentinel(
        deployed.prior_potential_fn,
        deployed.postprocess_fn,
        deployed.client_potential_fn,
        deployed.block_loader,
        deployed.init_params,
    )
    with pytest.raises(ValueError, match="deployment"):
        deployed.client_potentials(z)


def test_deployment_refuses_what_it_cannot_split(tmp_path):
    loader = save_per_client(tmp_path)

    def local_effects(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=3):
            eta = numpyro.sample("eta", dist.Normal(X @ w, 1.0))
            numpyro.sample("y", dist.Normal(eta, 1.0), obs=y)

    with pytest.raises(ValueError, match="global latent variables and one federated data plate.*eta"):
        nf.split_potential(local_effects, loader=loader, num_clients=3)
    with pytest.raises(ValueError, match="declares 3 clients, but there are 2 loaders"):
        nf.split_potential(logistic, loader=loader, num_clients=2)
    with pytest.raises(ValueError, match="not both"):
        nf.split_potential(logistic, pooled_rows(), loader=loader, num_clients=3)


def test_a_federation_given_a_loader_gives_the_algorithms_their_rows(tmp_path):
    from numpyro_fed.infer.base import build_potential

    loader = save_per_client(tmp_path)
    with pytest.raises(ValueError, match="together"):
        InProcess(loader=loader)
    with pytest.raises(TypeError, match="loader must be a function"):
        InProcess(loader=[1, 2], num_clients=2)
    fed = InProcess(loader=loader, num_clients=3)
    assert fed.deployed and not InProcess().deployed
    assert "num_clients=3" in repr(fed) and "loader=" in repr(fed)
    with pytest.raises(ValueError, match="without data arguments"):
        build_potential(logistic, pooled_rows(), federation=fed)
    deployed = build_potential(logistic, federation=fed)
    assert deployed.deployed and deployed.client_sizes.tolist() == COUNTS
    # an algorithm's own layout of a block, built where the client lives
    program = deployed.client_program(
        {"n": lambda block: block["valid"].sum()}, transform=lambda block: {"valid": block["valid"]["data"]}
    )
    assert program.blocks is None
    fed.start(program)
    assert jax.jit(lambda f: f.map("n"))(fed).tolist() == COUNTS
    X, y = pooled_rows()
    simulated = nf.split_potential(logistic, (X, y), {"clients": OWNER})
    blocks = simulated.client_program({}, transform=lambda block: block["valid"]["data"]).blocks
    assert [int(b.sum()) for b in blocks] == COUNTS


def test_deployment_on_ray_the_driver_never_holds_rows(ray_federation, tmp_path):
    X, y = pooled_rows()
    simulated = nf.split_potential(logistic, (X, y), {"clients": OWNER})
    with contextlib.nullcontext(ray_federation) as fed:
        deployed = nf.split_potential(logistic, loader=save_per_client(tmp_path), num_clients=3, federation=fed)
        fed.start(potential_program(deployed))
        z = deployed.init_params
        with fed.guard():
            values = jax.jit(lambda z: fed.map("value", z))(z)
            grads = jax.jit(jax.vmap(lambda z: fed.map("grad", z)))(jax.tree.map(lambda a: jnp.stack([a, a + 0.5]), z))
        np.testing.assert_array_equal(values, simulated.client_potentials(z))
        np.testing.assert_allclose(
            grads["w"][1], simulated.client_grads(jax.tree.map(lambda a: a + 0.5, z))["w"], rtol=1e-13
        )
        assert not holds_sentinel(
            deployed.prior_potential_fn,
            deployed.postprocess_fn,
            deployed.client_potential_fn,
            deployed.block_loader,
            fed.block_specs,
            fed.program,
        )


@pytest.mark.slow
def test_the_run_across_machines_page_runs(ray_session):
    """docs/guide/federation.md: its python examples run as printed (a fresh interpreter that
    starts its own local Ray)."""
    import subprocess
    import sys

    from test_docs import ROOT, page_examples

    code = page_examples("guide/federation.md", float32=False)
    assert "nf.RayFederation" in code
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[0] == "(3, 2)"
    assert "grad: rounds [1, 1, 1]" in run.stdout


def test_one_ray_federation_runs_a_server_algorithm_then_a_decentralized_one_then_again(ray_federation):
    """The same RayFederation serves DPPVI (client actors), DADMMS (agent actors, which replace
    them) and DPPVI again (client actors again), each with the answer of its in-process run."""
    from numpyro.infer import MCMC

    def gaussian_prior_logistic(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=3):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    X, y = pooled_rows()
    X[COUNTS[0], 0] = 0.5
    key = jax.random.PRNGKey(0)

    def pvi(federation):
        return nf.DPPVI(gaussian_prior_logistic, federation=federation, progress_bar=False).run(key, 1, X, y).state.q

    def admm(federation):
        mcmc = MCMC(
            nf.DADMMS(gaussian_prior_logistic, federation=federation),
            num_warmup=0,
            num_samples=3,
            num_chains=2,
            chain_method="vectorized",
            progress_bar=False,
        )
        with federation.guard():
            mcmc.run(key, X, y)
        return mcmc.get_samples()["w"]

    expected_q, expected_w = pvi(InProcess()), admm(InProcess())
    for answer, expected in [
        (pvi(ray_federation), expected_q),
        (admm(ray_federation), expected_w),
        (pvi(ray_federation), expected_q),
    ]:
        for a, b in zip(jax.tree.leaves(answer), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
