"""The synthetic problems of the papers this package reproduces.

The generators follow the experiment sections of

* Bierkens, Duncan et al. (2022), *Federated Bayesian computation via
  piecewise deterministic Markov chain Monte Carlo* (Fed-PDMC):
  :func:`fed_pdmc_gaussian` (Sec. 6.1), :func:`fed_pdmc_logistic` (Sec. 6.2),
  :func:`student_t_ar1` (Sec. 6.3), :func:`fed_pdmc_lgcp` (App. E.1);
* Tzikas et al. (2024), *Distributed MCMC sampling via ADMM* (D-ADMMS):
  :func:`dadmms_linear` (Sec. 6.2), :func:`dadmms_logistic` (Sec. 6.3);
* Kassab & Simeone, *Federated generalized Bayesian learning via distributed
  Stein variational gradient descent* (DSVGD): :func:`dsvgd_mixture_1d`
  (Sec. 7, Figs. 2-3, App. B.1).

Each takes a ``seed`` for a :func:`numpy.random.default_rng` generator (an
existing :class:`numpy.random.Generator` is also accepted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from numpyro_fed._checks import check_int as _check_int
from numpyro_fed._checks import check_positive as _check_positive
from numpyro_fed._checks import check_real as _check_real

__all__ = [
    "AR1Problem",
    "GaussianMeanProblem",
    "GaussianMixture1D",
    "LGCPProblem",
    "LinearGaussianProblem",
    "LogisticProblem",
    "MixtureToy1D",
    "dadmms_linear",
    "dadmms_logistic",
    "dsvgd_mixture_1d",
    "fed_pdmc_gaussian",
    "fed_pdmc_lgcp",
    "fed_pdmc_logistic",
    "student_t_ar1",
]


@dataclass(frozen=True, eq=False)
class GaussianMeanProblem:
    """Data ``y`` (``(n, d)``) from ``N(true_mean, noise_cov)``, flat prior on the mean.

    ``posterior_mean`` and ``posterior_cov`` give the exact posterior
    ``N(mean(y), noise_cov / n)``.
    """

    y: np.ndarray
    true_mean: np.ndarray
    noise_cov: np.ndarray
    posterior_mean: np.ndarray
    posterior_cov: np.ndarray


@dataclass(frozen=True, eq=False)
class LogisticProblem:
    """Bayesian logistic regression data: ``P(y=1 | X) = sigmoid(X @ true_coef)``.

    The prior on the coefficients is ``N(0, prior_variance * I)``. ``owner`` is
    the owner array of the paper's split over agents, or ``None`` when the
    paper leaves the split to the experiment (use :mod:`numpyro_fed.partition`).
    """

    X: np.ndarray
    y: np.ndarray
    true_coef: np.ndarray
    prior_variance: float
    owner: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class LinearGaussianProblem:
    """Bayesian linear regression ``y = X @ coef + N(0, noise_std**2)``, prior ``N(0, prior_variance I)``.

    ``posterior_mean`` and ``posterior_cov`` are the exact Gaussian posterior;
    ``owner`` gives each row's agent.
    """

    X: np.ndarray
    y: np.ndarray
    owner: np.ndarray
    true_coef: np.ndarray
    noise_std: float
    prior_variance: float
    posterior_mean: np.ndarray
    posterior_cov: np.ndarray


@dataclass(frozen=True, eq=False)
class AR1Problem:
    """Trajectories of ``Y_k = intercept + coef * Y_{k-1} + eps_k``, ``eps_k ~ Student-t(df)``.

    ``series`` has shape ``(num_series, num_steps + 1)``; column 0 is the
    initial value ``Y_0`` the likelihood conditions on.
    """

    series: np.ndarray
    true_intercept: float
    true_coef: float
    df: float

    @property
    def previous(self) -> np.ndarray:
        """``Y_{k-1}`` for ``k = 1..K``, shape ``(num_series, num_steps)``."""
        return self.series[:, :-1]

    @property
    def current(self) -> np.ndarray:
        """``Y_k`` for ``k = 1..K``, shape ``(num_series, num_steps)``."""
        return self.series[:, 1:]


@dataclass(frozen=True, eq=False)
class LGCPProblem:
    """Counts on a ``g x g`` grid, ``y_k ~ Poisson(exp(x_k))``, latent ``x ~ N(0, precision^-1)``.

    Nodes are numbered row-major, ``k = i * g + j`` for grid cell ``(i, j)``; ``coords``
    holds ``(i, j)`` per node. ``precision = beta (I - alpha adjacency)`` with ``adjacency``
    the 4-neighbour grid graph. ``owner`` gives each node's client (square spatial blocks);
    ``latent`` is the draw of ``x`` the counts were generated from.
    """

    counts: np.ndarray
    latent: np.ndarray
    precision: np.ndarray
    adjacency: np.ndarray
    owner: np.ndarray
    coords: np.ndarray
    alpha: float
    beta: float


@dataclass(frozen=True, eq=False)
class GaussianMixture1D:
    """Density proportional to ``sum_j weights[j] * N(theta | means[j], variances[j])`` on ``[lower, upper]``.

    Weights need not sum to one: the density is normalised over
    ``[lower, upper]`` (the whole line by default).
    """

    weights: np.ndarray
    means: np.ndarray
    variances: np.ndarray
    lower: float = -math.inf
    upper: float = math.inf

    def _component_masses(self) -> np.ndarray:
        scale = np.sqrt(self.variances)
        return stats.norm.cdf(self.upper, self.means, scale) - stats.norm.cdf(self.lower, self.means, scale)

    @property
    def component_probabilities(self) -> np.ndarray:
        """Probability that a draw comes from each (truncated) component."""
        mass = self.weights * self._component_masses()
        return mass / mass.sum()

    def log_pdf(self, theta) -> np.ndarray:
        """Normalised log density at ``theta`` (``-inf`` outside ``[lower, upper]``)."""
        theta = np.asarray(theta, dtype=float)
        log_terms = np.log(self.weights) + stats.norm.logpdf(theta[..., None], self.means, np.sqrt(self.variances))
        log_density = special.logsumexp(log_terms, axis=-1) - np.log(np.sum(self.weights * self._component_masses()))
        inside = (theta >= self.lower) & (theta <= self.upper)
        return np.where(inside, log_density, -np.inf)

    def mean(self) -> float:
        """Exact mean (truncated-normal moments when bounded)."""
        scale = np.sqrt(self.variances)
        a = (self.lower - self.means) / scale
        b = (self.upper - self.means) / scale
        component_means = stats.truncnorm.mean(a, b, loc=self.means, scale=scale)
        return float(np.sum(self.component_probabilities * component_means))

    def sample(self, num_samples: int, seed=None) -> np.ndarray:
        """Exact draws, shape ``(num_samples,)``."""
        num_samples = _check_int(num_samples, "num_samples", minimum=1)
        rng = np.random.default_rng(seed)
        component = rng.choice(self.means.size, size=num_samples, p=self.component_probabilities)
        scale = np.sqrt(self.variances)[component]
        loc = self.means[component]
        return stats.truncnorm.rvs(
            (self.lower - loc) / scale,
            (self.upper - loc) / scale,
            loc=loc,
            scale=scale,
            size=num_samples,
            random_state=rng,
        )


@dataclass(frozen=True, eq=False)
class MixtureToy1D:
    """The DSVGD 1-D mixture toy: prior, each agent's likelihood, exact global posterior.

    The global posterior is ``q_opt(theta) ∝ p0(theta) * prod_k exp(-L_k(theta))``
    (DSVGD Eq. (2) with temperature ``alpha = 1``), a two-component Gaussian
    mixture (truncated to the prior's support when the prior is uniform).
    """

    prior: str
    prior_params: tuple[float, float]
    local_likelihoods: tuple[GaussianMixture1D, ...]
    posterior: GaussianMixture1D
    support: tuple[float, float] = (-math.inf, math.inf)

    @property
    def num_agents(self) -> int:
        return len(self.local_likelihoods)

    def log_prior(self, theta) -> np.ndarray:
        """Normalised log prior density ``log p0(theta)``."""
        theta = np.asarray(theta, dtype=float)
        if self.prior == "uniform":
            low, high = self.prior_params
            inside = (theta >= low) & (theta <= high)
            return np.where(inside, -np.log(high - low), -np.inf)
        mean, variance = self.prior_params
        return stats.norm.logpdf(theta, mean, math.sqrt(variance))

    def local_log_likelihood(self, agent: int, theta) -> np.ndarray:
        """``-L_k(theta)`` of agent ``k`` (up to an additive constant)."""
        agent = _check_int(agent, "agent", minimum=0)
        if agent >= self.num_agents:
            raise ValueError(f"agent must be < {self.num_agents}, got {agent}")
        return self.local_likelihoods[agent].log_pdf(theta)

    def log_posterior(self, theta) -> np.ndarray:
        """Exact, normalised ``log q_opt(theta)``."""
        return self.posterior.log_pdf(theta)


def fed_pdmc_gaussian(
    seed, n: int = 50, d: int = 10, *, noise_std: float = 1.0, true_mean: float = 0.5
) -> GaussianMeanProblem:
    """Fed-PDMC Section 6.1: the mean of a multivariate normal.

    ``n`` observations ``y_i ~ N(mu_0, alpha^2 I_d)`` with
    ``mu_0 = (0.5, ..., 0.5)`` and ``alpha = noise_std = 1``. With the paper's
    flat prior on ``mu`` the posterior is ``N(mean(y), alpha^2 I / n)``,
    returned as ``posterior_mean``/``posterior_cov``. (The paper spreads the
    rows evenly over the workers: :func:`numpyro_fed.partition.even`.)

    >>> problem = fed_pdmc_gaussian(0)
    >>> problem.y.shape, float(problem.posterior_cov[0, 0])
    ((50, 10), 0.02)
    """
    n = _check_int(n, "n", minimum=1)
    d = _check_int(d, "d", minimum=1)
    noise_std = _check_positive(noise_std, "noise_std")
    true_mean = _check_real(true_mean, "true_mean")
    rng = np.random.default_rng(seed)
    mu0 = np.full(d, true_mean)
    y = mu0 + noise_std * rng.standard_normal((n, d))
    noise_cov = noise_std**2 * np.eye(d)
    return GaussianMeanProblem(
        y=y,
        true_mean=mu0,
        noise_cov=noise_cov,
        posterior_mean=y.mean(axis=0),
        posterior_cov=noise_cov / n,
    )


def fed_pdmc_logistic(
    seed, n: int = 1000, d: int = 6, *, prior_std: float = 1.0, covariate_std: float = 1.0
) -> LogisticProblem:
    """Fed-PDMC Section 6.2 (and App. F.2): Bayesian logistic regression.

    ``N = 1000`` synthetic observations in ``d = 6`` dimensions; the first
    covariate is the constant 1 (intercept); the prior is standard normal.
    The paper does not say how covariates and the true coefficients were
    drawn; here the other covariates are iid ``N(0, covariate_std^2)`` and
    ``true_coef`` is a draw from the prior ``N(0, prior_std^2 I)``.
    Labels are ``Bernoulli(sigmoid(X @ true_coef))``. Split the rows over
    workers with :mod:`numpyro_fed.partition`.

    >>> problem = fed_pdmc_logistic(0)
    >>> problem.X.shape, float(problem.X[:, 0].min()), problem.prior_variance
    ((1000, 6), 1.0, 1.0)
    """
    n = _check_int(n, "n", minimum=1)
    d = _check_int(d, "d", minimum=1)
    prior_std = _check_positive(prior_std, "prior_std")
    covariate_std = _check_positive(covariate_std, "covariate_std")
    rng = np.random.default_rng(seed)
    true_coef = prior_std * rng.standard_normal(d)
    X = np.concatenate([np.ones((n, 1)), covariate_std * rng.standard_normal((n, d - 1))], axis=1)
    y = (rng.uniform(size=n) < special.expit(X @ true_coef)).astype(float)
    return LogisticProblem(X=X, y=y, true_coef=true_coef, prior_variance=prior_std**2)


def student_t_ar1(
    seed,
    num_series: int = 100,
    num_steps: int = 10,
    *,
    df: float = 3.0,
    intercept: float = 0.5,
    coef: float = 0.5,
    initial_value: float = 0.0,
) -> AR1Problem:
    """Fed-PDMC Section 6.3 (and App. F.3): AR(1) with Student-t innovations.

    ``N = num_series`` independent trajectories ``Y_k = c + x Y_{k-1} + eps_k``
    with ``eps_k ~ t(df)`` (unit scale), each observed at ``K = num_steps``
    points after the initial value ``Y_0 = initial_value``. The posterior of
    ``(x, c)`` under the paper's flat prior is
    ``prod_i prod_k g(y_k - c - x y_{k-1})`` with ``g`` the ``t(df)`` density.
    The paper fixes none of ``N, K, nu, c, x, Y_0``; the defaults here are
    this package's choice. Trajectories are the unit to split over workers.

    >>> problem = student_t_ar1(0, num_series=4, num_steps=3)
    >>> problem.series.shape, problem.previous.shape
    ((4, 4), (4, 3))
    """
    num_series = _check_int(num_series, "num_series", minimum=1)
    num_steps = _check_int(num_steps, "num_steps", minimum=1)
    df = _check_positive(df, "df")
    intercept = _check_real(intercept, "intercept")
    coef = _check_real(coef, "coef")
    initial_value = _check_real(initial_value, "initial_value")
    rng = np.random.default_rng(seed)
    innovations = rng.standard_t(df, size=(num_series, num_steps))
    series = np.empty((num_series, num_steps + 1))
    series[:, 0] = initial_value
    for k in range(num_steps):
        series[:, k + 1] = intercept + coef * series[:, k] + innovations[:, k]
    return AR1Problem(series=series, true_intercept=intercept, true_coef=coef, df=df)


def _grid_adjacency(grid_size: int) -> np.ndarray:
    """Adjacency matrix of the 4-neighbour ``grid_size x grid_size`` grid, nodes row-major."""
    grid_size = _check_int(grid_size, "grid_size", minimum=1)
    index = np.arange(grid_size * grid_size).reshape(grid_size, grid_size)
    adjacency = np.zeros((index.size, index.size))
    for a, b in ((index[:, :-1], index[:, 1:]), (index[:-1, :], index[1:, :])):
        adjacency[a.ravel(), b.ravel()] = adjacency[b.ravel(), a.ravel()] = 1.0
    return adjacency


def fed_pdmc_lgcp(
    seed, grid_size: int = 4, *, alpha: float = 0.1, beta: float = 1.0, blocks_per_side: int = 2
) -> LGCPProblem:
    """Fed-PDMC Appendix E.1 (and F.4): a log-Gaussian Cox model on a grid.

    Counts ``y_k ~ Poisson(exp(x_k))`` on the ``grid_size x grid_size`` grid, with the
    latent field ``x ~ N(0, P^-1)``, ``P = beta (I - alpha A)`` and ``A`` the grid's
    adjacency (4 neighbours). The grid is cut into ``blocks_per_side^2`` square blocks of
    neighbouring nodes, one client each (the paper: a 4 x 4 grid over 4 clients, Figure 6);
    a client's likelihood touches only its own nodes, the prior couples them on the server.
    The paper does not give the data; here ``x`` is drawn from the prior and ``y`` from the
    model. ``P`` must be positive definite (``alpha < 1 / lambda_max(A)``, e.g.
    ``alpha < 0.25`` on every grid).

    >>> problem = fed_pdmc_lgcp(0)
    >>> problem.counts.shape, problem.owner.reshape(4, 4).tolist()[0], problem.precision[0, :2].tolist()
    ((16,), [0, 0, 1, 1], [1.0, -0.1])
    """
    grid_size = _check_int(grid_size, "grid_size", minimum=1)
    blocks_per_side = _check_int(blocks_per_side, "blocks_per_side", minimum=1)
    if grid_size % blocks_per_side:
        raise ValueError(f"blocks_per_side={blocks_per_side} must divide grid_size={grid_size} (square blocks)")
    alpha = _check_real(alpha, "alpha")
    beta = _check_positive(beta, "beta")
    adjacency = _grid_adjacency(grid_size)
    precision = beta * (np.eye(grid_size * grid_size) - alpha * adjacency)
    eigenvalues = np.linalg.eigvalsh(precision)
    if eigenvalues.min() <= 0:
        raise ValueError(
            f"alpha={alpha} makes the precision beta (I - alpha A) singular or indefinite "
            f"(smallest eigenvalue {eigenvalues.min():.3g}); take |alpha| < 1 / lambda_max(A)"
        )
    rng = np.random.default_rng(seed)
    # x = L^-T z with P = L L^T has covariance P^-1
    cholesky = np.linalg.cholesky(precision)
    latent = np.linalg.solve(cholesky.T, rng.standard_normal(grid_size * grid_size))
    counts = rng.poisson(np.exp(latent)).astype(float)
    i, j = np.divmod(np.arange(grid_size * grid_size), grid_size)
    block = grid_size // blocks_per_side
    owner = (i // block) * blocks_per_side + j // block
    return LGCPProblem(
        counts=counts,
        latent=latent,
        precision=precision,
        adjacency=adjacency,
        owner=owner,
        coords=np.stack([i, j], axis=1),
        alpha=alpha,
        beta=beta,
    )


def dadmms_linear(
    seed,
    num_agents: int = 20,
    n_per_agent: int = 50,
    *,
    d: int = 2,
    noise_std: float = 4.0,
    prior_variance: float = 10.0,
) -> LinearGaussianProblem:
    """D-ADMMS Section 6.2: distributed Bayesian linear regression.

    ``x ~ N(0, lambda I)`` in ``R^2``; each agent has ``n_i`` rows
    ``z ~ N(0, I)``, ``y = x^T z + delta``, ``delta ~ N(0, xi^2)`` with
    ``xi = noise_std = 4`` and ``lambda = prior_variance = 10`` (the prior
    variance: Eq. (27) puts ``||x||^2 / (2 lambda N)`` in each of the ``N``
    agents' potentials). The paper uses 5, 20 or 100 agents and
    ``n_i`` = 50 or 200. The exact posterior is Gaussian with covariance
    ``(Z^T Z / xi^2 + I / lambda)^{-1}`` and mean ``cov @ Z^T y / xi^2``.
    Rows are grouped by agent; ``owner`` says which.

    >>> problem = dadmms_linear(0, num_agents=5, n_per_agent=50)
    >>> problem.X.shape, problem.posterior_cov.shape, problem.owner[-1].item()
    ((250, 2), (2, 2), 4)
    """
    num_agents = _check_int(num_agents, "num_agents", minimum=1)
    n_per_agent = _check_int(n_per_agent, "n_per_agent", minimum=1)
    d = _check_int(d, "d", minimum=1)
    noise_std = _check_positive(noise_std, "noise_std")
    prior_variance = _check_positive(prior_variance, "prior_variance")
    rng = np.random.default_rng(seed)
    true_coef = math.sqrt(prior_variance) * rng.standard_normal(d)
    n = num_agents * n_per_agent
    X = rng.standard_normal((n, d))
    y = X @ true_coef + noise_std * rng.standard_normal(n)
    precision = X.T @ X / noise_std**2 + np.eye(d) / prior_variance
    posterior_cov = np.linalg.inv(precision)
    posterior_cov = (posterior_cov + posterior_cov.T) / 2
    posterior_mean = np.linalg.solve(precision, X.T @ y / noise_std**2)
    return LinearGaussianProblem(
        X=X,
        y=y,
        owner=np.repeat(np.arange(num_agents), n_per_agent),
        true_coef=true_coef,
        noise_std=noise_std,
        prior_variance=prior_variance,
        posterior_mean=posterior_mean,
        posterior_cov=posterior_cov,
    )


def dadmms_logistic(
    seed,
    num_agents: int = 20,
    n_per_agent: int = 50,
    *,
    d: int = 3,
    prior_variance: float = 10.0,
    covariate_variance: float = 20.0,
) -> LogisticProblem:
    """D-ADMMS Section 6.3: distributed Bayesian logistic regression.

    ``x ~ N(0, lambda I)`` in ``R^3`` with ``lambda = 10``; each row
    ``z ~ N(0, 20 I)`` (20 is a variance, as in the authors' code),
    ``p ~ U(0, 1)`` and ``y = 1`` if ``p <= sigmoid(x^T z)``. The paper uses
    ``n_i = 50`` rows per agent and 5, 20 or 50 agents. (The paper lists each
    agent's label-1 rows first; that order is notation only and is not
    reproduced.) The posterior has no closed form; the paper reports accuracy.

    >>> problem = dadmms_logistic(0, num_agents=5)
    >>> problem.X.shape, sorted(set(problem.y.tolist()))
    ((250, 3), [0.0, 1.0])
    """
    num_agents = _check_int(num_agents, "num_agents", minimum=1)
    n_per_agent = _check_int(n_per_agent, "n_per_agent", minimum=1)
    d = _check_int(d, "d", minimum=1)
    prior_variance = _check_positive(prior_variance, "prior_variance")
    covariate_variance = _check_positive(covariate_variance, "covariate_variance")
    rng = np.random.default_rng(seed)
    true_coef = math.sqrt(prior_variance) * rng.standard_normal(d)
    n = num_agents * n_per_agent
    X = math.sqrt(covariate_variance) * rng.standard_normal((n, d))
    y = (rng.uniform(size=n) <= special.expit(X @ true_coef)).astype(float)
    return LogisticProblem(
        X=X,
        y=y,
        true_coef=true_coef,
        prior_variance=prior_variance,
        owner=np.repeat(np.arange(num_agents), n_per_agent),
    )


def _gaussian_product(means, variances) -> tuple[float, float, float]:
    """``prod_i N(theta | m_i, v_i) = exp(log_scale) * N(theta | mean, variance)``."""
    means = np.asarray(means, dtype=float)
    variances = np.asarray(variances, dtype=float)
    precision = np.sum(1.0 / variances)
    mean = np.sum(means / variances) / precision
    log_scale = (
        -0.5 * np.sum(np.log(2 * np.pi * variances))
        + 0.5 * np.log(2 * np.pi / precision)
        - 0.5 * (np.sum(means**2 / variances) - precision * mean**2)
    )
    return float(mean), float(1.0 / precision), float(log_scale)


def dsvgd_mixture_1d(prior: str = "gaussian") -> MixtureToy1D:
    """DSVGD's 1-D Gaussian mixture toy (Sec. 7, Figs. 2-3; App. B.1, Fig. 9a).

    Two agents with local likelihoods ``exp(-L_1) = N(theta | 1, 4)`` and
    ``exp(-L_2) = N(theta | -3, 1) + N(theta | 3, 2)`` (second argument read
    as a variance), temperature ``alpha = 1``. The global posterior
    ``q_opt ∝ p0 * exp(-L_1) * exp(-L_2)`` is then an exact two-component
    Gaussian mixture, returned as :attr:`MixtureToy1D.posterior` with
    ``log_pdf``, ``mean`` and exact ``sample``.

    :param prior: ``"gaussian"`` for ``p0 = N(0, 1)``, which App. B.1 uses for
        the KL-versus-rounds comparison with PVI/GVI (Fig. 9a, and, as the
        same comparison, Fig. 3); ``"uniform"`` for ``p0 = U(-6, 6)``, the
        prior of Fig. 2 (the posterior is then truncated to ``[-6, 6]``).

    >>> toy = dsvgd_mixture_1d()
    >>> toy.num_agents, toy.posterior.means.shape
    (2, (2,))
    >>> bool(abs(toy.posterior.sample(20_000, seed=0).mean() - toy.posterior.mean()) < 0.05)
    True
    """
    if prior not in ("gaussian", "uniform"):
        raise ValueError(f"prior must be 'gaussian' or 'uniform', got {prior!r}")
    likelihood_1 = GaussianMixture1D(np.array([1.0]), np.array([1.0]), np.array([4.0]))
    likelihood_2 = GaussianMixture1D(np.array([1.0, 1.0]), np.array([-3.0, 3.0]), np.array([1.0, 2.0]))
    if prior == "gaussian":
        prior_params = (0.0, 1.0)
        prior_factors = ([0.0], [1.0])
        lower, upper = -math.inf, math.inf
    else:
        prior_params = (-6.0, 6.0)
        # A flat prior adds no Gaussian factor; it only truncates.
        prior_factors = ([], [])
        lower, upper = prior_params

    log_weights, means, variances = [], [], []
    for weight, mean, variance in zip(likelihood_2.weights, likelihood_2.means, likelihood_2.variances):
        product_mean, product_variance, log_scale = _gaussian_product(
            [*prior_factors[0], likelihood_1.means[0], mean],
            [*prior_factors[1], likelihood_1.variances[0], variance],
        )
        log_weights.append(np.log(weight) + log_scale)
        means.append(product_mean)
        variances.append(product_variance)
    log_weights = np.array(log_weights)
    posterior = GaussianMixture1D(
        weights=np.exp(log_weights - log_weights.max()),
        means=np.array(means),
        variances=np.array(variances),
        lower=lower,
        upper=upper,
    )
    return MixtureToy1D(
        prior=prior,
        prior_params=prior_params,
        local_likelihoods=(likelihood_1, likelihood_2),
        posterior=posterior,
        support=(lower, upper),
    )
