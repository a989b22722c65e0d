"""Client-local latents in deployment (``loader=``): each client's loader returns its rows and
declares its groups (``nf.GroupIndex``, in the client's own numbering); the server lays the
group plates out from the clients' group counts, and every algorithm gives the simulation's
answer for the same key."""

import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.federation import InProcess

from helpers import SENTINEL, holds_sentinel
from models import SCHOOL_ARGS, eight_schools
from runs import assert_same_run

M = 4

# -- eight schools: two schools per client, one estimate per school --------------------------


def school_loader(folder):
    """Client m's schools (2m, 2m + 1) in its own file, and the loader that reads them back with
    the schools numbered 0, 1 on the client."""
    for m in range(M):
        rows = slice(2 * m, 2 * m + 2)
        np.savez(os.path.join(folder, f"school_{m}.npz"), sigma=SCHOOL_ARGS[1][rows], y=SCHOOL_ARGS[2][rows])

    def load(m):
        data = np.load(os.path.join(folder, f"school_{m}.npz"))
        return nf.GroupIndex("schools", np.arange(2), num_groups=2), data["sigma"], data["y"]

    return load


# -- a small radon: log radon on floor, an intercept per county, counties client-local ------

GROUPS = [2, 3, 1, 2]  # counties per client
COUNTY_OWNER = np.repeat(np.arange(M), GROUPS)


def radon_rows(seed=0):
    """Per client: floor, county in the client's numbering, log radon (client 1's first
    floor is the sentinel)."""
    rng = np.random.default_rng(seed)
    out = []
    for m, groups in enumerate(GROUPS):
        county = np.repeat(np.arange(groups), rng.integers(2, 6, size=groups))
        floor = rng.integers(0, 2, size=county.size).astype(np.float64)
        if m == 1:
            floor[0] = SENTINEL
        intercept = 1.3 + 0.4 * rng.normal(size=groups)
        y = intercept[county] - 0.7 * floor + 0.8 * rng.normal(size=county.size)
        out.append((floor, county, y))
    return out


def pooled_radon(seed=0):
    """The simulation's arguments: the clients' rows in client order, counties numbered
    globally (client m's after those of clients 0..m-1)."""
    rows = radon_rows(seed)
    offsets = np.cumsum([0] + GROUPS[:-1])
    floor = np.concatenate([r[0] for r in rows])
    county = np.concatenate([r[1] + offsets[m] for m, r in enumerate(rows)])
    y = np.concatenate([r[2] for r in rows])
    return floor, county, y


ROW_OWNER = np.concatenate([np.full(r[0].size, m) for m, r in enumerate(radon_rows())])


def radon(floor, county, y):
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 10.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfCauchy(2.5))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    sigma_y = numpyro.sample("sigma_y", dist.HalfCauchy(2.5))
    with nf.federated_plate("counties", sum(GROUPS), clients=COUNTY_OWNER):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
    with nf.federated_plate("data", y.shape[0], clients=ROW_OWNER):
        numpyro.sample("y", dist.Normal(a[county] + b * floor, sigma_y), obs=y)


def radon_loader(folder, seed=0, dtype=np.float64, groups=None):
    """Each client's rows in its own file; ``load(m)`` reads them back and records the process it
    runs in. ``groups``: the numbers of groups the loaders declare (default the true ones)."""
    groups = list(GROUPS if groups is None else groups)
    for m, (floor, county, y) in enumerate(radon_rows(seed)):
        np.savez(os.path.join(folder, f"radon_{m}.npz"), floor=floor, county=county, y=y)

    def load(m):
        with open(os.path.join(folder, "pids"), "a") as f:
            f.write(f"{os.getpid()}\n")
        data = np.load(os.path.join(folder, f"radon_{m}.npz"))
        county = nf.GroupIndex("counties", data["county"], num_groups=groups[m])
        return data["floor"].astype(dtype), county, data["y"].astype(dtype)

    return load


CASES = {
    "eight_schools": (lambda: eight_schools(M), lambda: SCHOOL_ARGS, school_loader),
    "radon": (lambda: radon, pooled_radon, radon_loader),
}


def case(name, tmp_path):
    model, args, loader = CASES[name]
    return model(), args(), loader(str(tmp_path))


def potential_program(fp):
    client_potential = fp.client_potential_fn
    return fp.client_program(
        {
            "value": lambda block, z: client_potential(z, block),
            "grad": lambda block, z: jax.grad(client_potential)(z, block),
        }
    )


# -- the layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_deployed_split_is_the_simulated_one_bit_for_bit(tmp_path, name):
    """The group plates are owned as the loaders declared (client m the next num_groups rows);
    each client's term and gradient, the prior term and the constrained values are the
    simulation's, and nothing the server keeps holds a row."""
    model, args, load = case(name, tmp_path)
    simulated = nf.split_potential(model, args)
    deployed = nf.split_potential(model, loader=load, num_clients=M)
    assert deployed.deployed and deployed.client_data is None
    for plate, info in simulated.plates.items():
        np.testing.assert_array_equal(deployed.plates[plate].owner, info.owner)
    np.testing.assert_array_equal(deployed.coordinate_owner, simulated.coordinate_owner)
    z = jax.tree.map(lambda a: a + 0.3, simulated.init_params)
    fed = InProcess().start(potential_program(deployed))
    values = jax.jit(lambda f, z: f.map("value", z))(fed, z)
    grads = jax.jit(lambda f, z: f.map("grad", z))(fed, z)
    np.testing.assert_array_equal(values, simulated.client_potentials(z))
    for site, grad in simulated.client_grads(z).items():
        np.testing.assert_array_equal(grads[site], grad)
    np.testing.assert_array_equal(deployed.prior_potential(z), simulated.prior_potential(z))
    for site, value in simulated.postprocess_fn(z).items():
        np.testing.assert_array_equal(deployed.postprocess_fn(z)[site], value)
    if name == "radon":
        assert holds_sentinel(simulated.client_data)  # the check sees rows when they are there
        assert not holds_sentinel(
            deployed.prior_potential_fn,
            deployed.client_potential_fn,
            deployed.postprocess_fn,
            deployed.block_loader,
            deployed.init_params,
            deployed.stand_in_arguments,
        )
        assert "groups={'counties': [2, 3, 1, 2]}" in repr(deployed.block_loader)


def test_the_deployed_split_in_float32(tmp_path):
    """In float32 (NumPyro's default) the loaders' float32 rows give the simulation's terms."""
    numpyro.enable_x64(False)
    try:
        floor, county, y = pooled_radon()
        simulated = nf.split_potential(radon, (floor.astype(np.float32), county, y.astype(np.float32)))
        deployed = nf.split_potential(radon, loader=radon_loader(str(tmp_path), dtype=np.float32), num_clients=M)
        z = simulated.init_params
        assert z["a"].dtype == jnp.float32
        fed = InProcess().start(potential_program(deployed))
        values = jax.jit(lambda f, z: f.map("value", z))(fed, z)
        assert values.dtype == jnp.float32
        np.testing.assert_array_equal(values, simulated.client_potentials(z))
    finally:
        numpyro.enable_x64(True)


# -- bad input -------------------------------------------------------------------------------


def test_group_index_refuses_bad_declarations():
    with pytest.raises(ValueError, match=r"GroupIndex\('counties'\): index holds 3, outside this client's groups 0..2"):
        nf.GroupIndex("counties", np.array([0, 3]), num_groups=3)
    with pytest.raises(ValueError, match="num_groups must be an int >= 1, not 0"):
        nf.GroupIndex("counties", np.array([0]), num_groups=0)
    with pytest.raises(ValueError, match="integer array with the rows on its leading axis.*float64"):
        nf.GroupIndex("counties", np.array([0.0, 1.0]), num_groups=2)
    with pytest.raises(ValueError, match=r"shape \(\)"):
        nf.GroupIndex("counties", 1, num_groups=2)
    with pytest.raises(TypeError, match="name of a federated plate"):
        nf.GroupIndex(3, np.array([0]), num_groups=1)


def test_deployment_refuses_group_declarations_that_do_not_fit_the_model(tmp_path):
    folder = str(tmp_path)
    # client 2 declares a county without rows: 9 counties, the model has 8
    with pytest.raises(
        ValueError, match=r"plate 'counties' has size 8 in the model, but the loaders declare 9 .*2 \+ 3 \+ 2 \+ 2"
    ):
        nf.split_potential(radon, loader=radon_loader(folder, groups=[2, 3, 2, 2]), num_clients=M)

    def plain(m):  # the county index without a declaration
        floor, county, y = radon_rows()[m]
        return floor, county, y

    with pytest.raises(ValueError, match=r"plate 'counties' holds client-local latent site\(s\) \['a'\].*GroupIndex"):
        nf.split_potential(radon, loader=plain, num_clients=M)

    def wrong_plate(m):
        floor, county, y = radon_rows()[m]
        return floor, nf.GroupIndex("county", county, num_groups=GROUPS[m]), y

    with pytest.raises(ValueError, match=r"GroupIndex for plate\(s\) \['county'\].*\['counties'\]"):
        nf.split_potential(radon, loader=wrong_plate, num_clients=M)

    def some_clients(m):
        floor, county, y = radon_rows()[m]
        return floor, (nf.GroupIndex("counties", county, num_groups=GROUPS[m]) if m else county), y

    with pytest.raises(ValueError, match="client 1's loader declares group indices"):
        nf.split_potential(radon, loader=some_clients, num_clients=M)


def test_a_loader_that_changes_its_groups_after_set_up_is_refused_naming_the_client(tmp_path):
    folder = str(tmp_path)
    load = radon_loader(folder)
    deployed = nf.split_potential(radon, loader=load, num_clients=M)
    changed = radon_loader(folder, groups=[2, 3, 2, 2])  # client 2 now says 2 counties
    block_loader = deployed.block_loader
    block_loader.loader = changed
    block_loader(1)  # the others still load
    with pytest.raises(ValueError, match="client 2: the loader declares 2 groups of plate 'counties'; at set-up.* 1"):
        block_loader(2)


def test_row_local_latents_are_still_refused_by_name(tmp_path):
    def row_effects(floor, county, y):
        b = numpyro.sample("b", dist.Normal(0.0, 10.0))
        with nf.federated_plate("data", y.shape[0], clients=M):
            eta = numpyro.sample("eta", dist.Normal(b * floor, 1.0))
            numpyro.sample("y", dist.Normal(eta, 1.0), obs=y)

    with pytest.raises(ValueError, match=r"one value per data row \['eta'\]"):
        nf.split_potential(row_effects, loader=radon_loader(str(tmp_path)), num_clients=M)


# -- every algorithm: deployed in process is the simulation ---------------------------------

KEY = jax.random.PRNGKey(3)


def _mcmc(kernel, args, *, chains=1):
    mcmc = MCMC(kernel, num_warmup=3, num_samples=6, num_chains=chains, chain_method="vectorized", progress_bar=False)
    mcmc.run(KEY, *args)
    return mcmc


def run_algorithm(algorithm, model, args, federation=None, **options):
    """A short run: the draws (or the fitted state) as a list of arrays."""
    if algorithm == "FedZigZag":
        mcmc = _mcmc(nf.FedZigZag(model, federation=federation, **options), args)
        return [np.asarray(v) for _, v in sorted(mcmc.get_samples().items())]
    if algorithm == "DADMMS":
        mcmc = _mcmc(nf.DADMMS(model, federation=federation), args, chains=2)
        draws = nf.DADMMS.agent_draws(mcmc, group_by_chain=True)
        return [np.asarray(v) for _, v in sorted(draws.items())]
    if algorithm == "DPPVI":
        result = nf.DPPVI(model, num_local_steps=3, progress_bar=False, federation=federation).run(KEY, 1, *args)
    else:
        result = nf.DSVGD(model, num_particles=6, num_local_steps=3, progress_bar=False, federation=federation).run(
            KEY, 1, *args
        )
    return result


ALGORITHMS = ["FedZigZag", "DADMMS", "DPPVI", "DSVGD"]


def as_arrays(run):
    """The draws, or every leaf of a variational run's state."""
    return run if isinstance(run, list) else [np.asarray(leaf) for leaf in jax.tree.leaves(run.state)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # short runs: their own checks warn
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deployed_in_process_is_the_simulation_bit_for_bit(tmp_path, algorithm, name):
    model, args, load = case(name, tmp_path)
    simulated = as_arrays(run_algorithm(algorithm, model, args))
    deployed = as_arrays(run_algorithm(algorithm, model, (), InProcess(loader=load, num_clients=M)))
    assert len(deployed) == len(simulated)
    for a, b in zip(deployed, simulated):
        np.testing.assert_array_equal(a, b)


# -- on Ray: each worker loads its own rows and declares its counties -----------------------


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "algorithm",
    [
        "FedZigZag",
        "DADMMS",
        "DPPVI",
        "DSVGD",
    ],
)
def test_deployed_on_ray_is_the_in_process_deployment(ray_session, tmp_path, algorithm):
    # FedZigZag's draws are the same numbers in process and on Ray when the clients thin (as
    # the zigzag federation tests run it)
    options = {"sample_interval": 0.5, "thinning": "clients"} if algorithm == "FedZigZag" else {}
    load = radon_loader(str(tmp_path))
    local = run_algorithm(algorithm, radon, (), InProcess(loader=load, num_clients=M), **options)
    (tmp_path / "pids").unlink()
    with nf.RayFederation(loader=load, num_clients=M, timeout=120.0) as federation:
        with federation.guard():
            remote = run_algorithm(algorithm, radon, (), federation, **options)
    pids = {int(p) for p in (tmp_path / "pids").read_text().split()}
    assert pids and os.getpid() not in pids  # only the workers read the clients' files
    if not isinstance(local, list):  # a variational run: the clients kept their states on Ray
        stein = {k: v for k, v in local.metrics.items() if not k.startswith("stein")}
        # DPPVI's mean-field local fits start from variational Newton steps (eigh, solve on
        # each client's joint (theta, z_m)): compiled alone on a Ray worker they round to the
        # last bit differently from the same functions compiled in process (measured: 3
        # coordinates of q's eta1 1 ulp apart)
        assert_same_run(remote, local._replace(metrics=stein), state_rtol=1e-12 if algorithm == "DPPVI" else 0.0)
        return
    assert len(remote) == len(local)
    for a, b in zip(remote, local):
        # each client's function compiled alone on its worker rounds as vmapped in process, or
        # to round-off (as the engines' other deployed-vs-simulation checks)
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_dsvgd_correction_and_draws_of_local_latents_on_ray_are_the_in_process_deployments(ray_session, tmp_path):
    """DSVGD's steps after the rounds with client-local latents on Ray: Stein's moment correction
    with the clients' marginal scores (every client scheduled: ``"marginal_score"`` calls on the
    workers) and the draws of the counties' intercepts given the global particles (a
    ``"draw_latents"`` call), against the same deployment in process."""
    load = radon_loader(str(tmp_path))

    def run(federation):
        method = nf.DSVGD(radon, num_particles=6, num_local_steps=3, progress_bar=False, federation=federation)
        result = method.run(KEY, M, *())
        return result, method.get_samples(jax.random.PRNGKey(1), result, 50)

    local, local_draws = run(InProcess(loader=load, num_clients=M))
    with nf.RayFederation(loader=load, num_clients=M, timeout=120.0) as federation:
        with federation.guard():
            remote, remote_draws = run(federation)
    assert local.ledger["marginal_score/messages_from_client"].min() >= 2  # the check and a correction
    np.testing.assert_array_equal(
        remote.ledger["marginal_score/messages_from_client"], local.ledger["marginal_score/messages_from_client"]
    )
    np.testing.assert_allclose(remote.state.global_particles, local.state.global_particles, rtol=1e-9, atol=1e-11)
    assert remote_draws["a"].shape == (50, sum(GROUPS))
    for site in local_draws:
        np.testing.assert_allclose(remote_draws[site], local_draws[site], rtol=1e-9, atol=1e-11, err_msg=site)
