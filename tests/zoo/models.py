"""The zoo's models, their data and their references.

Every entry is an ordinary NumPyro model with a :func:`~numpyro_fed.federated_plate`,
data drawn from a fixed seed, and a reference posterior that this project did not compute:

* ``closed_form``: exact posterior means and sds on NumPyro's unconstrained space
  (conjugate Gaussian models, Gamma-Poisson and Beta-Bernoulli through the digamma and
  trigamma functions, a 1-D posterior by quadrature);
* otherwise NumPyro NUTS on the pooled model (``reference_model``: the same model made
  non-centred with :class:`~numpyro.infer.reparam.LocScaleReparam` where NUTS needs it).

Comparisons are made coordinate by coordinate on the flat unconstrained latent vector
(sites in the order the model samples them, each flattened row-major), where the
posteriors are closest to Gaussian and a posterior sd is a meaningful unit.

``build()`` returns ``(model, args)`` with the data as float64 NumPy arrays (integer arrays
stay integer); the worker casts them to the dtype of the run.
"""

import dataclasses
from typing import Callable

import numpy as np
from scipy import special

import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.handlers import reparam
from numpyro.infer.reparam import LocScaleReparam

import numpyro_fed as nf

__all__ = ["ZooCase", "CASES", "get_case"]


@dataclasses.dataclass(frozen=True)
class ZooCase:
    """One model of the zoo.

    :ivar name: identifier (``tests/zoo`` parameter ids, table rows).
    :ivar what: one line for the table: what the model stresses.
    :ivar build: ``() -> (model, args)``.
    :ivar num_clients: ``M`` (DSVGD's number of rounds follows it).
    :ivar closed_form: ``() -> (mean, sd)`` on the flat unconstrained space, or ``None``
        (then NUTS on ``reference_model``).
    :ivar reference_model: ``() -> (model, args)`` for NUTS (default: ``build``).
    :ivar local_sites: client-local latent sites (each client keeps its own).
    :ivar float64: also run the model in float64 (every model runs in float32, NumPyro's
        default).
    :ivar issue: the issue item whose exact case this is.
    :ivar mean_field: for a Gaussian posterior, ``() -> (mean, sd)`` of the best mean-field
        Gaussian (the minimiser of KL(q || p): the exact mean, and ``1 / sqrt(diag(precision))``).
    :ivar reference_draws: draws per chain of the NUTS reference (2 chains, 1000 warmup
        steps each); longer where 3000 leave fewer than the harness's 400 effective draws.
    :ivar tier: ``"synthetic"`` (this module) or ``"real"`` (:mod:`zoo.real_models`: published
        models on real data, their own run lengths and tolerances, a committed NUTS reference).
    :ivar real_model: the real tier's model (one per split), whose reference the case uses.
    """

    name: str
    what: str
    build: Callable
    num_clients: int
    closed_form: Callable | None = None
    reference_model: Callable | None = None
    local_sites: tuple = ()
    float64: bool = False
    issue: str = ""
    nuts: dict = dataclasses.field(default_factory=dict)
    reference_draws: int = 3000
    mean_field: Callable | None = None
    tier: str = "synthetic"
    real_model: str = ""


# -- shared model shapes ------------------------------------------------------------------------


def _linear_regression(prior_sd, noise_sd, clients):
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, prior_sd).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Normal(X @ w, noise_sd), obs=y)

    return model


def _linear_regression_posterior(X, y, prior_sd, noise_sd, mean_field=False):
    """Exact Gaussian posterior of ``w`` (known noise): precision ``X'X/s^2 + I/s0^2``; with
    ``mean_field``, the sds of the best mean-field Gaussian instead of the marginal sds."""
    precision = X.T @ X / noise_sd**2 + np.eye(X.shape[1]) / prior_sd**2
    cov = np.linalg.inv(precision)
    mean = cov @ (X.T @ y) / noise_sd**2
    return mean, (np.diag(precision) ** -0.5 if mean_field else np.sqrt(np.diag(cov)))


def _logistic_regression(clients):
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model


def _gaussian_mean(prior_sd, noise_sd, clients):
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, prior_sd))
        with nf.federated_plate("data", y.shape[0], clients=clients):
            numpyro.sample("y", dist.Normal(mu, noise_sd), obs=y)

    return model


def _linreg_case(X, y, prior_sd, noise_sd, clients):
    build = lambda: (_linear_regression(prior_sd, noise_sd, clients), (X, y))
    closed = lambda: _linear_regression_posterior(X, y, prior_sd, noise_sd)
    mean_field = lambda: _linear_regression_posterior(X, y, prior_sd, noise_sd, mean_field=True)
    return build, closed, mean_field


# -- issue 12, item 4: the conjugate Gaussian mean, in two systems of units ---------------------

_GM_Y = 1.0 + np.random.default_rng(40).normal(size=100)
_GM_SCALE = 0.01  # the rescaled problem: the same data in units 100 times smaller


def _gaussian_mean_case(scale):
    y, prior_sd, noise_sd = scale * _GM_Y, scale * 10.0, scale * 1.0

    def closed():
        precision = 1 / prior_sd**2 + y.size / noise_sd**2
        return np.array([y.sum() / noise_sd**2 / precision]), np.array([precision**-0.5])

    return (lambda: (_gaussian_mean(prior_sd, noise_sd, 4), (y,))), closed


# -- issue 12, item 6: the conjugate linear regression -----------------------------------------

_rng = np.random.default_rng(60)
_LR_X = _rng.normal(size=(200, 3))
_LR_Y = _LR_X @ np.array([1.0, -0.5, 0.25]) + _rng.normal(size=200)

# -- issue 12, item 4: logistic regression, 4 clients, 2000 rows -------------------------------

_rng = np.random.default_rng(41)
_LOG_X = _rng.normal(size=(2000, 5))
_LOG_Y = (_rng.uniform(size=2000) < 1 / (1 + np.exp(-_LOG_X @ np.array([0.8, -0.4, 0.0, 0.3, -0.1])))) * 1.0

# -- issue 12, item 1: the hierarchical logistic funnel ----------------------------------------

_FUNNEL_GROUP = np.repeat(np.arange(4), 50)
_FUNNEL_Y = (np.random.default_rng(1).uniform(size=200) < 0.5) * 1.0


def _funnel_logistic():
    def model(group, y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with nf.federated_plate("clients", 4, clients=4):
            a = numpyro.sample("a", dist.Normal(mu, tau))  # client-local, weakly identified
        with nf.federated_plate("data", y.shape[0], clients=_FUNNEL_GROUP):
            numpyro.sample("y", dist.Bernoulli(logits=a[group]), obs=y)

    return model, (_FUNNEL_GROUP, _FUNNEL_Y)


# -- eight schools: a centred funnel whose clients hold one row each ---------------------------

_SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
_SCHOOLS_SD = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def _eight_schools():
    def model(school, sd, y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with nf.federated_plate("schools", 8, clients=8):
            theta = numpyro.sample("theta", dist.Normal(mu, tau))
        with nf.federated_plate("data", 8, clients=8):
            numpyro.sample("y", dist.Normal(theta[school], sd), obs=y)

    return model, (np.arange(8), _SCHOOLS_SD, _SCHOOLS_Y)


def _non_centred(build, site):
    def reference():
        model, args = build()
        return reparam(model, config={site: LocScaleReparam(centered=0)}), args

    return reference


# -- constrained sites with exact posteriors: Gamma-Poisson and Beta-Bernoulli ------------------

_rng = np.random.default_rng(7)
_GB_COUNTS = _rng.poisson(3.0, size=30) * 1.0
_GB_FLAGS = (_rng.uniform(size=30) < 0.2) * 1.0


def _gamma_beta():
    def model(counts, flags):
        lam = numpyro.sample("lam", dist.Gamma(2.0, 1.0))
        p = numpyro.sample("p", dist.Beta(2.0, 2.0))
        with nf.federated_plate("data", counts.shape[0], clients=3):
            numpyro.sample("counts", dist.Poisson(lam), obs=counts)
            numpyro.sample("flags", dist.Bernoulli(probs=p), obs=flags)

    return model, (_GB_COUNTS, _GB_FLAGS)


def _gamma_beta_closed():
    # On the unconstrained space: log(lam) of a Gamma(a, b) has mean digamma(a) - log(b) and
    # variance trigamma(a); logit(p) of a Beta(a, b) has mean digamma(a) - digamma(b) and
    # variance trigamma(a) + trigamma(b).
    a, b = 2.0 + _GB_COUNTS.sum(), 1.0 + _GB_COUNTS.size
    c, d = 2.0 + _GB_FLAGS.sum(), 2.0 + _GB_FLAGS.size - _GB_FLAGS.sum()
    mean = np.array([special.digamma(a) - np.log(b), special.digamma(c) - special.digamma(d)])
    var = np.array([special.polygamma(1, a), special.polygamma(1, c) + special.polygamma(1, d)])
    return mean, np.sqrt(var)


# -- heavy tails: Student-t regression ---------------------------------------------------------

_rng = np.random.default_rng(3)
_T_X = _rng.normal(size=(60, 2))
_T_Y = _T_X @ np.array([1.0, -1.0]) + _rng.standard_t(2.0, size=60)


def _student_t():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 3.0).expand([2]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=4):
            numpyro.sample("y", dist.StudentT(3.0, X @ w, 1.0), obs=y)

    return model, (_T_X, _T_Y)


# -- strong correlation: d = 20, posterior condition number 1e3 --------------------------------


def _correlated_design(d=20, n=40, prior_sd=10.0, seed=20):
    """Rows ``X`` with ``X'X + I/prior_sd^2`` = ``Q diag(logspace(0, 3)) Q'`` (Q a random
    rotation): the posterior covariance has condition number exactly 1e3."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    precision = q @ np.diag(np.logspace(0, 3, d)) @ q.T
    chol = np.linalg.cholesky(precision - np.eye(d) / prior_sd**2)
    h, _ = np.linalg.qr(rng.normal(size=(n, d)))  # orthonormal columns: h'h = I
    X = h @ chol.T
    y = X @ rng.normal(size=d) + rng.normal(size=n)
    return X, y


_CORR_X, _CORR_Y = _correlated_design()

# -- d = 100 -------------------------------------------------------------------------------------

_rng = np.random.default_rng(100)
_D100_X = _rng.normal(size=(400, 100))
_D100_Y = _D100_X @ (0.5 * _rng.normal(size=100)) + _rng.normal(size=400)

# -- a bimodal posterior: y ~ N(theta^2, 1), modes at theta = +-1 --------------------------------

_BI_Y = np.array([1.3, 0.6, 1.4, 0.7])  # mean 1: modes near +-1, 2 nats of barrier at 0


def _bimodal():
    def model(y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 2.0))
        with nf.federated_plate("data", y.shape[0], clients=2):
            numpyro.sample("y", dist.Normal(theta**2, 1.0), obs=y)

    return model, (_BI_Y,)


def _bimodal_closed():
    grid = np.linspace(-8.0, 8.0, 160_001)  # the density is negligible beyond |theta| = 3
    log_density = -0.5 * (grid / 2.0) ** 2 - 0.5 * ((_BI_Y[:, None] - grid**2) ** 2).sum(0)
    weights = np.exp(log_density - log_density.max())
    weights /= weights.sum()
    mean = (weights * grid).sum()
    return np.array([mean]), np.array([np.sqrt((weights * (grid - mean) ** 2).sum())])


# -- very unequal clients (1:1000): Poisson regression ------------------------------------------

_rng = np.random.default_rng(1000)
_UNEQ_X = 0.5 * _rng.normal(size=(2002, 3))
_UNEQ_Y = _rng.poisson(np.exp(_UNEQ_X @ np.array([0.5, -0.3, 0.2]))) * 1.0
_UNEQ_OWNER = np.concatenate([np.zeros(2, int), np.ones(2000, int)])


def _unequal():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=_UNEQ_OWNER):
            numpyro.sample("y", dist.Poisson(jnp.exp(X @ w)), obs=y)

    return model, (_UNEQ_X, _UNEQ_Y)


# -- M = 1 ---------------------------------------------------------------------------------------

_rng = np.random.default_rng(11)
_M1_X = _rng.normal(size=(100, 3))
_M1_Y = (_rng.uniform(size=100) < 1 / (1 + np.exp(-_M1_X @ np.array([1.0, -1.0, 0.5])))) * 1.0

# -- M = 100 clients of 5 rows, and 12 clients of one row ---------------------------------------

_rng = np.random.default_rng(101)
_M100_X = _rng.normal(size=(500, 3))
_M100_Y = _M100_X @ np.array([0.5, 1.0, -1.0]) + _rng.normal(size=500)

_rng = np.random.default_rng(12)
_ROW_X = _rng.normal(size=(12, 2))
_ROW_Y = _ROW_X @ np.array([1.0, -1.0]) + _rng.normal(size=12)


def _cases():
    gm_build, gm_closed = _gaussian_mean_case(1.0)
    gmr_build, gmr_closed = _gaussian_mean_case(_GM_SCALE)
    lr_build, lr_closed, lr_mf = _linreg_case(_LR_X, _LR_Y, 1.0, 1.0, 4)
    corr_build, corr_closed, corr_mf = _linreg_case(_CORR_X, _CORR_Y, 10.0, 1.0, 4)
    d100_build, d100_closed, d100_mf = _linreg_case(_D100_X, _D100_Y, 1.0, 1.0, 4)
    m100_build, m100_closed, m100_mf = _linreg_case(_M100_X, _M100_Y, 1.0, 1.0, 100)
    row_build, row_closed, row_mf = _linreg_case(_ROW_X, _ROW_Y, 1.0, 1.0, 12)
    funnel_nuts = dict(target_accept_prob=0.95)
    return [
        ZooCase(
            "gaussian_mean",
            "conjugate Gaussian mean, 4 clients x 25 rows",
            gm_build,
            4,
            closed_form=gm_closed,
            mean_field=gm_closed,
            float64=True,
            issue="item 4",
        ),
        ZooCase(
            "gaussian_mean_rescaled",
            "the same in units 100x smaller",
            gmr_build,
            4,
            closed_form=gmr_closed,
            mean_field=gmr_closed,
            float64=True,
            issue="item 4",
        ),
        ZooCase(
            "linear_regression",
            "conjugate linear regression, d = 3, 4 x 50 rows",
            lr_build,
            4,
            closed_form=lr_closed,
            mean_field=lr_mf,
            float64=True,
            issue="item 6",
        ),
        ZooCase(
            "logistic_2000",
            "logistic regression, d = 5, 4 x 500 rows",
            lambda: (_logistic_regression(4), (_LOG_X, _LOG_Y)),
            4,
            float64=True,
            issue="item 4",
        ),
        ZooCase(
            "funnel_logistic",
            "centred random intercepts (client-local), Bernoulli(0.5) labels",
            _funnel_logistic,
            4,
            reference_model=_non_centred(_funnel_logistic, "a"),
            local_sites=("a",),
            float64=True,
            issue="item 1",
            nuts=funnel_nuts,
            reference_draws=12000,  # 3000 left mu with 342 effective draws
        ),
        ZooCase(
            "eight_schools",
            "centred funnel, HalfCauchy scale, clients of one row",
            _eight_schools,
            8,
            reference_model=_non_centred(_eight_schools, "theta"),
            local_sites=("theta",),
            nuts=funnel_nuts,
        ),
        ZooCase(
            "gamma_beta",
            "constrained sites: Gamma-Poisson and Beta-Bernoulli",
            _gamma_beta,
            3,
            closed_form=_gamma_beta_closed,
            float64=True,
        ),
        ZooCase("student_t", "heavy tails: Student-t(3) regression on t(2) noise", _student_t, 4),
        ZooCase(
            "correlated_d20",
            "d = 20, posterior condition number 1e3",
            corr_build,
            4,
            closed_form=corr_closed,
            mean_field=corr_mf,
        ),
        ZooCase(
            "bimodal", "two modes (y ~ N(theta^2, 1)), 2 nats of barrier", _bimodal, 2, closed_form=_bimodal_closed
        ),
        ZooCase(
            "linear_d100",
            "d = 100 linear regression, 4 x 100 rows",
            d100_build,
            4,
            closed_form=d100_closed,
            mean_field=d100_mf,
        ),
        ZooCase("unequal_clients", "Poisson regression, clients of 2 and 2000 rows", _unequal, 2),
        ZooCase(
            "single_client",
            "M = 1: logistic regression, 100 rows",
            lambda: (_logistic_regression(1), (_M1_X, _M1_Y)),
            1,
        ),
        ZooCase(
            "many_clients",
            "M = 100 clients of 5 rows, linear regression",
            m100_build,
            100,
            closed_form=m100_closed,
            mean_field=m100_mf,
        ),
        ZooCase(
            "one_row_clients",
            "12 clients of one row each, linear regression",
            row_build,
            12,
            closed_form=row_closed,
            mean_field=row_mf,
        ),
    ]


CASES = {case.name: case for case in _cases()}


def get_case(name: str) -> ZooCase:
    """A case of either tier (the real tier's cases are named ``MODEL-mM``, M clients)."""
    if name in CASES:
        return CASES[name]
    from zoo.real_models import REAL_CASES  # imports this module: not at the top

    return REAL_CASES[name]
