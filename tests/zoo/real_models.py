"""The zoo's real-model tier: published models on real data, as a statistician writes them.

Each model is written once, as in its source (Gelman & Hill's regressions, the radon
varying-intercept model, eight schools non-centred, the UCI benchmarks of the federated
literature, ...), with its priors as published or as an applied user would put them: flat
priors through :class:`~numpyro.distributions.ImproperUniform`, noise scales under
``HalfCauchy``, covariates on their raw scales. Each runs split over 4 and 8 clients: rows
evenly and contiguously for the regressions; for the hierarchical models by group (a
county's or a school's rows on one client, its effect client-local).

The data are the CSVs of ``tests/zoo/data/`` (sources and licences in its README;
``tools/zoo_real_data.py`` regenerates them) and, for the UCI models, the files of
``../shared/data`` (``ZOO_DATA`` overrides the folder; without it those models are left out).

References: NumPyro NUTS on the pooled model in float64, 4 chains, split R-hat below 1.01,
computed once by ``tools/zoo_real_references.py`` and committed as JSON under
``tests/zoo/references/``; a reference whose model or data changed is refused as stale.
"""

import csv
import functools
import os

import numpy as np

import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.handlers import reparam
from numpyro.infer.initialization import init_to_median
from numpyro.infer.reparam import LocScaleReparam

import numpyro_fed as nf

from zoo.models import ZooCase

__all__ = ["MODELS", "RealModel", "REAL_CASES", "SPLITS", "data_dir", "shared_data_dir"]

ZOO_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(os.path.dirname(ZOO_DIR))
REFERENCES_DIR = os.path.join(ZOO_DIR, "references")
SPLITS = (4, 8)


def data_dir():
    return os.path.join(ZOO_DIR, "data")


def shared_data_dir():
    """The UCI files (``../shared/data`` of the project, or ``ZOO_DATA``), or ``None``."""
    path = os.environ.get("ZOO_DATA", os.path.join(REPO_DIR, "..", "shared", "data"))
    return path if os.path.isdir(os.path.join(path, "uci_adult")) else None


@functools.lru_cache(maxsize=None)
def _csv(name):
    with open(os.path.join(data_dir(), f"{name}.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: [r[k] for r in rows] for k in rows[0]}


def _num(name, column):
    return np.asarray(_csv(name)[column], dtype=np.float64)


def _flat(size):
    """A flat prior on ``size`` real coordinates (improper)."""
    return dist.ImproperUniform(constraints.real, (), (size,))


def _even(n, clients):
    """Client of each of ``n`` rows: contiguous blocks of (nearly) equal size."""
    return np.arange(n) * clients // n


def _by_group(group, clients):
    """``(owner of each group, owner of each row)``: contiguous runs of groups, so that each
    client holds about ``n / clients`` rows and every group's rows sit on one client."""
    num_groups = int(group.max()) + 1
    counts = np.bincount(group, minlength=num_groups)
    before = np.concatenate([[0], np.cumsum(counts)[:-1]]) + counts / 2.0
    owner = np.minimum((before * clients / counts.sum()).astype(int), clients - 1)
    if len(np.unique(owner)) != clients:
        raise ValueError(f"{num_groups} groups do not cover {clients} clients")
    return owner, owner[group]


# -- linear regressions ------------------------------------------------------------------------


def _linear(flat_prior, prior_sd=10.0, noise_scale=5.0):
    """``y ~ Normal(alpha + X beta, sigma)``: flat or ``Normal(0, prior_sd)`` coefficients,
    ``sigma ~ HalfCauchy(noise_scale)``."""

    def build(X, y, clients):
        def model(X, y):
            d = X.shape[1]
            if flat_prior:
                alpha = numpyro.sample("alpha", dist.ImproperUniform(constraints.real, (), ()))
                beta = numpyro.sample("beta", _flat(d))
            else:
                alpha = numpyro.sample("alpha", dist.Normal(0.0, prior_sd))
                beta = numpyro.sample("beta", dist.Normal(0.0, prior_sd).expand([d]).to_event(1))
            sigma = numpyro.sample("sigma", dist.HalfCauchy(noise_scale))
            with nf.federated_plate("data", X.shape[0], clients=clients):
                numpyro.sample("y", dist.Normal(alpha + X @ beta, sigma), obs=y)

        return model, (X, y)

    return build


@functools.lru_cache(maxsize=None)
def _kidiq():
    return np.stack([_num("kidiq", "mom_hs"), _num("kidiq", "mom_iq")], 1), _num("kidiq", "kid_score")


@functools.lru_cache(maxsize=None)
def _kidiq_interaction():
    hs, iq = _num("kidiq", "mom_hs"), _num("kidiq", "mom_iq")
    return np.stack([hs, iq, hs * iq], 1), _num("kidiq", "kid_score")


@functools.lru_cache(maxsize=None)
def _earnings():
    earn = _num("earnings", "earn")
    keep = earn > 0  # Gelman & Hill model log earnings of those who earn
    X = np.stack([_num("earnings", "height")[keep], _num("earnings", "male")[keep]], 1)
    return X, np.log(earn[keep])


@functools.lru_cache(maxsize=None)
def _mtcars():
    columns = ["cyl", "disp", "hp", "drat", "wt", "qsec", "vs", "am", "gear", "carb"]
    return np.stack([_num("mtcars", c) for c in columns], 1), _num("mtcars", "mpg")


def _uci_rows(path, num_rows):
    return np.loadtxt(path, max_rows=num_rows)


@functools.lru_cache(maxsize=None)
def _kin8nm():
    raw = _uci_rows(os.path.join(shared_data_dir(), "kin8nm", "kin8nm.txt"), 2000)
    return raw[:, :-1], raw[:, -1]


@functools.lru_cache(maxsize=None)
def _protein():
    raw = _uci_rows(os.path.join(shared_data_dir(), "protein", "protein_structure.txt"), 2000)
    X = raw[:, :-1]
    return (X - X.mean(0)) / X.std(0), raw[:, -1]  # standardised, as the literature does


# -- generalised linear models -----------------------------------------------------------------


def _wells_build(X, y, clients):
    """Gelman & Hill's arsenic wells: switch ~ distance (metres, raw) + arsenic, flat priors."""

    def model(X, y):
        alpha = numpyro.sample("alpha", dist.ImproperUniform(constraints.real, (), ()))
        beta = numpyro.sample("beta", _flat(X.shape[1]))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Bernoulli(logits=alpha + X @ beta), obs=y)

    return model, (X, y)


@functools.lru_cache(maxsize=None)
def _wells():
    return np.stack([_num("wells", "dist"), _num("wells", "arsenic")], 1), _num("wells", "switched")


def _logistic_build(X, y, clients):
    """Logistic regression, ``Normal(0, 10)`` coefficients on raw covariates."""

    def model(X, y):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 10.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Bernoulli(logits=alpha + X @ beta), obs=y)

    return model, (X, y)


@functools.lru_cache(maxsize=None)
def _adult():
    """UCI Adult, the first 5000 rows of ``adult.data``: > 50K on age, years of education,
    hours per week (raw) and sex."""
    rows = []
    with open(os.path.join(shared_data_dir(), "uci_adult", "adult.data")) as f:
        for line in f:
            fields = [s.strip() for s in line.split(",")]
            if len(fields) == 15:
                rows.append(fields)
            if len(rows) == 5000:
                break
    X = np.array([[float(r[0]), float(r[4]), float(r[12]), float(r[9] == "Male")] for r in rows])
    return X, np.array([float(r[14] == ">50K") for r in rows])


def _ships_build(X, offset, y, clients):
    """McCullagh & Nelder's ship damage: Poisson counts with offset log(months of service)."""

    def model(X, offset, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 5.0).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Poisson(jnp.exp(offset + X @ beta)), obs=y)

    return model, (X, offset, y)


@functools.lru_cache(maxsize=None)
def _ships():
    table = _csv("ships")
    service = np.asarray(table["service"], dtype=np.float64)
    keep = service > 0  # the six cells with no service have no exposure
    kinds, year, period = np.asarray(table["type"])[keep], _num("ships", "year")[keep], _num("ships", "period")[keep]
    columns = [np.ones(keep.sum())]
    columns += [(kinds == t) * 1.0 for t in "BCDE"]
    columns += [(year == v) * 1.0 for v in (65.0, 70.0, 75.0)]
    columns += [(period == 75.0) * 1.0]
    return np.stack(columns, 1), np.log(service[keep]), _num("ships", "incidents")[keep]


def _faithful_build(y, clients):
    """Old Faithful's waiting times: a two-component normal mixture (no discrete latent)."""

    def model(y):
        w = numpyro.sample("w", dist.Dirichlet(jnp.ones(2)))
        mu = numpyro.sample("mu", dist.Normal(jnp.array([55.0, 80.0]), 10.0).to_event(1))
        sigma = numpyro.sample("sigma", dist.HalfCauchy(5.0).expand([2]).to_event(1))
        with nf.federated_plate("data", y.shape[0], clients=clients):
            mix = dist.MixtureSameFamily(dist.Categorical(probs=w), dist.Normal(mu, sigma))
            numpyro.sample("y", mix, obs=y)

    return model, (y,)


# -- hierarchical models: group effects client-local -------------------------------------------


def _radon_build(clients):
    """Gelman & Hill's radon in Minnesota: log radon on the floor of measurement with a varying
    intercept per county (85 counties), counties client-local."""
    county = _num("radon_mn", "county_idx").astype(np.int64) - 1
    county_owner, row_owner = _by_group(county, clients)

    def model(floor, county, y):
        mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 10.0))
        sigma_a = numpyro.sample("sigma_a", dist.HalfCauchy(2.5))
        b = numpyro.sample("b", dist.Normal(0.0, 10.0))
        sigma_y = numpyro.sample("sigma_y", dist.HalfCauchy(2.5))
        with nf.federated_plate("counties", 85, clients=county_owner):
            a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
        with nf.federated_plate("data", y.shape[0], clients=row_owner):
            numpyro.sample("y", dist.Normal(a[county] + b * floor, sigma_y), obs=y)

    return model, (_num("radon_mn", "floor_measure"), county, _num("radon_mn", "log_radon"))


def _eight_schools_build(clients):
    """Rubin's eight schools, non-centred; each school's effect client-local."""
    owner = _even(8, clients)

    def model(school, sigma, y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with nf.federated_plate("schools", 8, clients=owner):
            theta_tilde = numpyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
            numpyro.deterministic("theta", mu + tau * theta_tilde)
        with nf.federated_plate("data", y.shape[0], clients=owner):
            numpyro.sample("y", dist.Normal(mu + tau * theta_tilde[school], sigma), obs=y)

    return model, (np.arange(8), _num("eight_schools", "sigma"), _num("eight_schools", "y"))


# -- the registry --------------------------------------------------------------------------------


class RealModel:
    """One published model: ``build(clients) -> (model, args)``; ``pooled()`` the model NUTS runs
    for the reference (the same model on all rows, reparametrised where NUTS needs it)."""

    def __init__(self, name, what, source, build, *, local_sites=(), uci=False, reference_reparam=None, nuts=None):
        self.name, self.what, self.source = name, what, source
        self.build, self.local_sites, self.uci = build, tuple(local_sites), uci
        self.reference_reparam = reference_reparam
        self.nuts = dict(nuts or {})  # NUTS settings of the reference (e.g. a dense mass matrix)

    def pooled(self):
        model, args = self.build(1)
        if self.reference_reparam:
            model = reparam(model, config={self.reference_reparam: LocScaleReparam(centered=0)})
        return model, args

    def reference_path(self):
        return os.path.join(REFERENCES_DIR, f"{self.name}.json")


def _rows(data_fn, build_fn):
    return lambda clients: build_fn(*data_fn(), _even(len(data_fn()[-1]), clients))


_MODELS = [
    RealModel(
        "kidiq",
        "kid score ~ mom_hs + mom_iq (raw), flat priors, sigma ~ HalfCauchy(5); 434 rows",
        "Gelman & Hill (2007) ch. 3; posteriordb kidiq",
        _rows(_kidiq, _linear(flat_prior=True)),
    ),
    RealModel(
        "kidiq_interaction",
        "kid score with the mom_hs x mom_iq interaction: correlated coefficients, flat priors",
        "Gelman & Hill (2007) ch. 3; posteriordb kidiq_interaction",
        _rows(_kidiq_interaction, _linear(flat_prior=True)),
    ),
    RealModel(
        "earnings",
        "log earnings ~ height (inches, raw) + male, Normal(0, 10), sigma ~ HalfCauchy(5); 1192 rows",
        "Gelman & Hill (2007) ch. 4; posteriordb earnings",
        _rows(_earnings, _linear(flat_prior=False)),
    ),
    RealModel(
        "mtcars",
        "mpg on all 10 raw covariates of mtcars (strongly correlated), Normal(0, 10); 32 rows",
        "Henderson & Velleman (1981); R datasets::mtcars",
        _rows(_mtcars, _linear(flat_prior=False)),
        nuts={"dense_mass": True},
    ),
    RealModel(
        "wells",
        "arsenic wells: switch ~ distance (metres, raw) + arsenic, logistic, flat priors; 3020 rows",
        "Gelman & Hill (2007) ch. 5; posteriordb wells_data",
        _rows(_wells, _wells_build),
    ),
    RealModel(
        "ships",
        "ship damage: Poisson with offset log(service), 9 coefficients; 34 rows",
        "McCullagh & Nelder (1989) 6.3.2; R MASS::ships",
        _rows(_ships, _ships_build),
    ),
    RealModel(
        "faithful_mixture",
        "two-component normal mixture on Old Faithful's waiting times; 272 rows",
        "Azzalini & Bowman (1990); R datasets::faithful",
        _rows(lambda: (_num("faithful", "waiting"),), _faithful_build),
        # from NumPyro's default init_to_uniform every chain can settle in the label-swapped mode
        # (mu = (80, 55)), which the priors make about 6 nats less likely: start at the prior medians
        nuts={"init_strategy": init_to_median(num_samples=15)},
    ),
    RealModel(
        "radon",
        "log radon ~ floor + county intercept (85, client-local), HalfCauchy scales; 919 rows",
        "Gelman & Hill (2007) ch. 12; posteriordb radon_mn",
        _radon_build,
        local_sites=("a",),
        reference_reparam="a",
    ),
    RealModel(
        "eight_schools",
        "eight schools, non-centred, tau ~ HalfCauchy(5), school effects client-local",
        "Rubin (1981); posteriordb eight_schools_noncentered",
        _eight_schools_build,
        local_sites=("theta_tilde",),
    ),
    RealModel(
        "adult",
        "UCI Adult, 5000 rows: > 50K on age, education, hours (raw) and sex, logistic",
        "UCI Machine Learning Repository (CC BY 4.0)",
        _rows(_adult, _logistic_build),
        uci=True,
    ),
    RealModel(
        "kin8nm",
        "kin8nm, 2000 rows, 8 inputs: linear regression, Normal(0, 10), sigma ~ HalfCauchy(5)",
        "DELVE kin8nm",
        _rows(_kin8nm, _linear(flat_prior=False)),
        uci=True,
    ),
    RealModel(
        "protein",
        "UCI protein structure (CASP), 2000 rows, 9 standardised features: linear regression",
        "UCI Machine Learning Repository (CC BY 4.0)",
        _rows(_protein, _linear(flat_prior=False)),
        uci=True,
    ),
]
MODELS = {m.name: m for m in _MODELS if not m.uci or shared_data_dir() is not None}


def _case(model, clients):
    return ZooCase(
        f"{model.name}-m{clients}",
        model.what,
        lambda: model.build(clients),
        clients,
        local_sites=model.local_sites,
        float64=True,
        tier="real",
        real_model=model.name,
    )


REAL_CASES = {case.name: case for case in (_case(m, c) for m in MODELS.values() for c in SPLITS)}
