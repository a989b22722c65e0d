"""Loaders (real data from ../shared/data, and tiny hand-written files) and synthetic generators."""

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import optimize, special, stats
from scipy.integrate import trapezoid
from sklearn.linear_model import Ridge

from numpyro_fed import datasets

DATA_ROOT = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def data_folder(name):
    folder = DATA_ROOT / name
    if not folder.is_dir():
        pytest.skip(f"shared data folder {folder} is missing")
    return folder


# --------------------------------------------------------------------------
# Adult


ADULT_DATA_LINES = """\
39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States, <=50K
50, Self-emp-not-inc, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, Husband, White, Male, 0, 0, 13, United-States, >50K
38, ?, 215646, HS-grad, 9, Divorced, ?, Not-in-family, White, Female, 0, 0, 40, ?, <=50K

"""
ADULT_TEST_LINES = """\
|1x3 Cross validator
25, Private, 226802, 11th, 7, Never-married, Machine-op-inspct, Own-child, Black, Male, 0, 0, 40, United-States, <=50K.
44, Private, 160323, Some-college, 10, Married-civ-spouse, Machine-op-inspct, Husband, Black, Male, 7688, 0, 40, United-States, >50K.
"""


@pytest.fixture
def tiny_adult(tmp_path):
    (tmp_path / "adult.data").write_text(ADULT_DATA_LINES)
    (tmp_path / "adult.test").write_text(ADULT_TEST_LINES)
    return tmp_path


def test_load_adult_tiny_files_parse_labels_and_missing_values(tiny_adult):
    data = datasets.load_adult(tiny_adult, test_fraction=0.4, seed=0)
    assert data.X_train.shape[0] == 3 and data.X_test.shape[0] == 2
    names = data.feature_names
    assert names[:6] == ("age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week")
    for missing in ("workclass=?", "occupation=?", "native-country=?"):
        assert missing in names
    assert "workclass=Private" in names and "sex=Female" in names
    X = np.concatenate([data.X_train, data.X_test])
    y = np.concatenate([data.y_train, data.y_test])
    # two positives, one of them written '>50K.' in the test file
    assert y.sum() == 2
    # the row with workclass '?' is the 38-year-old earning <=50K
    question_workclass = X[:, names.index("workclass=?")] == 1
    assert question_workclass.sum() == 1
    assert y[question_workclass][0] == 0.0
    age = X[:, 0]  # standardised with one mean/std for both splits, so order-preserving
    assert age[question_workclass][0] == np.sort(age)[1]  # 38 is the 2nd smallest of 25, 38, 39, 44, 50
    assert X[question_workclass, names.index("native-country=?")][0] == 1
    # exactly one category per categorical column in every row
    assert np.all(X[:, 6:].sum(axis=1) == 8)


def test_load_adult_standardises_with_training_statistics(tiny_adult):
    data = datasets.load_adult(tiny_adult, test_fraction=0.4, seed=1)
    np.testing.assert_allclose(data.X_train[:, :6].mean(axis=0), 0.0, atol=1e-12)
    # fnlwgt is never constant, so its std is exactly 1 on the training split
    assert data.X_train[:, 1].std() == pytest.approx(1.0)


def test_load_adult_names_the_missing_file(tmp_path):
    (tmp_path / "adult.data").write_text(ADULT_DATA_LINES)
    with pytest.raises(FileNotFoundError, match="adult.test"):
        datasets.load_adult(tmp_path)
    with pytest.raises(FileNotFoundError, match="Adult folder not found"):
        datasets.load_adult(tmp_path / "nowhere")


def test_load_adult_rejects_malformed_rows(tmp_path):
    (tmp_path / "adult.data").write_text("39, State-gov, 77516\n")
    (tmp_path / "adult.test").write_text(ADULT_TEST_LINES)
    with pytest.raises(ValueError, match=r"adult.data:1: expected 15 comma-separated fields, got 3"):
        datasets.load_adult(tmp_path)


def test_load_adult_real_files():
    folder = data_folder("uci_adult")
    data = datasets.load_adult(folder, seed=0)
    assert data.X_train.shape == (39074, 108)
    assert data.X_test.shape == (9768, 108)
    assert data.X_train.dtype == np.float64 and data.y_train.dtype == np.float64
    assert len(data.feature_names) == 108
    assert data.y_mean is None and data.name == "adult"
    # positives counted straight from the raw text, independently of the parser
    raw_positives = sum(line.count(">50K") for name in ("adult.data", "adult.test") for line in open(folder / name))
    y = np.concatenate([data.y_train, data.y_test])
    assert y.sum() == raw_positives == 11687
    assert y.mean() == pytest.approx(0.239, abs=0.001)
    assert abs(data.y_train.mean() - 0.239) < 0.01
    np.testing.assert_allclose(data.X_train[:, :6].mean(axis=0), 0.0, atol=1e-10)
    np.testing.assert_allclose(data.X_train[:, :6].std(axis=0), 1.0, rtol=1e-10)
    # one-hot blocks: one category per column per row
    assert np.all(data.X_train[:, 6:].sum(axis=1) == 8)
    for missing in ("workclass=?", "occupation=?", "native-country=?"):
        assert data.X_train[:, data.feature_names.index(missing)].sum() > 0


def test_load_adult_split_is_seeded(tiny_adult):
    a = datasets.load_adult(tiny_adult, test_fraction=0.4, seed=3)
    b = datasets.load_adult(tiny_adult, test_fraction=0.4, seed=3)
    np.testing.assert_array_equal(a.X_train, b.X_train)
    splits = {tuple(datasets.load_adult(tiny_adult, test_fraction=0.4, seed=s).y_test) for s in range(10)}
    assert len(splits) > 1


# --------------------------------------------------------------------------
# regression benchmarks


def write_table(path, rows, cols, seed=0):
    table = np.random.default_rng(seed).normal(size=(rows, cols)) * np.arange(1, cols + 1) + 5.0
    np.savetxt(path, table)
    return table


def test_regression_loader_standardises_and_undoes(tmp_path):
    raw = write_table(tmp_path / "kin8nm.txt", 50, 9)
    data = datasets.load_kin8nm(tmp_path / "kin8nm.txt", test_fraction=0.2, seed=0)
    assert data.X_train.shape == (40, 8) and data.X_test.shape == (10, 8)
    np.testing.assert_allclose(data.X_train.mean(axis=0), 0.0, atol=1e-12)
    np.testing.assert_allclose(data.X_train.std(axis=0), 1.0)
    assert data.y_train.mean() == pytest.approx(0.0, abs=1e-12)
    assert data.y_train.std() == pytest.approx(1.0)
    # y_mean / y_std recover the raw target column (the last one), train and test alike
    recovered = np.concatenate([data.y_train, data.y_test]) * data.y_std + data.y_mean
    np.testing.assert_allclose(np.sort(recovered), np.sort(raw[:, -1]), rtol=1e-6)
    # the statistics are the training split's, not the whole file's
    assert data.y_mean != pytest.approx(raw[:, -1].mean(), rel=1e-9)


def test_regression_loader_errors(tmp_path):
    write_table(tmp_path / "protein_structure.txt", 20, 9)
    with pytest.raises(ValueError, match="protein: expected 10 whitespace-separated columns"):
        datasets.load_protein(tmp_path)
    with pytest.raises(FileNotFoundError, match="kin8nm.txt"):
        datasets.load_kin8nm(tmp_path)
    with pytest.raises(ValueError, match="test_fraction must lie strictly between 0 and 1"):
        datasets.load_protein(tmp_path, test_fraction=1.0)
    write_table(tmp_path / "kin8nm.txt", 3, 9)
    with pytest.raises(ValueError, match="leaves an empty split of 3 rows"):
        datasets.load_kin8nm(tmp_path, test_fraction=0.1)


def test_load_kin8nm_real_file():
    folder = data_folder("kin8nm")
    data = datasets.load_kin8nm(folder)
    assert data.X_train.shape == (7373, 8) and data.X_test.shape == (819, 8)
    raw_target = np.loadtxt(folder / "kin8nm.txt")[:, -1]
    recovered = np.concatenate([data.y_train, data.y_test]) * data.y_std + data.y_mean
    np.testing.assert_allclose(np.sort(recovered), np.sort(raw_target), rtol=1e-10)
    assert same_data_from_file_path(datasets.load_kin8nm, folder / "kin8nm.txt", data)


def test_load_protein_real_file():
    folder = data_folder("protein")
    data = datasets.load_protein(folder)
    assert data.X_train.shape == (41157, 9) and data.X_test.shape == (4573, 9)
    # target is the LAST column: RMSD in angstrom, 0 to about 21
    recovered = np.concatenate([data.y_train, data.y_test]) * data.y_std + data.y_mean
    assert recovered.min() == pytest.approx(0.0, abs=1e-6) and 20 < recovered.max() < 21
    assert data.feature_names == tuple(f"F{i}" for i in range(1, 10))


def same_data_from_file_path(loader, file_path, data):
    again = loader(file_path)
    return np.array_equal(again.X_train, data.X_train) and np.array_equal(again.y_test, data.y_test)


# --------------------------------------------------------------------------
# Fed-PDMC generators


def test_fed_pdmc_gaussian_posterior():
    problem = datasets.fed_pdmc_gaussian(0)
    assert problem.y.shape == (50, 10)
    np.testing.assert_allclose(problem.posterior_mean, problem.y.mean(axis=0))
    np.testing.assert_allclose(problem.posterior_cov, np.eye(10) / 50)
    np.testing.assert_array_equal(problem.true_mean, np.full(10, 0.5))
    big = datasets.fed_pdmc_gaussian(1, n=40_000, d=3, noise_std=2.0)
    assert np.all(np.abs(big.posterior_mean - 0.5) < 5 * 2.0 / math.sqrt(40_000))
    np.testing.assert_allclose(big.y.std(axis=0), 2.0, rtol=0.02)
    np.testing.assert_array_equal(datasets.fed_pdmc_gaussian(0).y, problem.y)


def test_fed_pdmc_logistic_follows_the_model():
    problem = datasets.fed_pdmc_logistic(0)
    assert problem.X.shape == (1000, 6) and problem.y.shape == (1000,)
    assert np.all(problem.X[:, 0] == 1.0)
    assert set(np.unique(problem.y)) <= {0.0, 1.0}
    assert problem.prior_variance == 1.0 and problem.owner is None
    big = datasets.fed_pdmc_logistic(1, n=50_000, d=4)

    # maximum likelihood on a large sample recovers the generating coefficients
    def negative_log_likelihood(coef):
        logits = big.X @ coef
        return np.mean(np.logaddexp(0.0, logits) - big.y * logits)

    def gradient(coef):
        return big.X.T @ (special.expit(big.X @ coef) - big.y) / big.y.size

    fit = optimize.minimize(negative_log_likelihood, np.zeros(4), jac=gradient, method="BFGS")
    assert np.abs(gradient(fit.x)).max() < 1e-5
    np.testing.assert_allclose(fit.x, big.true_coef, atol=0.1)


def test_student_t_ar1_innovations_are_student_t():
    problem = datasets.student_t_ar1(0, num_series=2000, num_steps=10, df=3.0, intercept=0.5, coef=0.7)
    assert problem.series.shape == (2000, 11)
    assert np.all(problem.series[:, 0] == 0.0)
    residuals = problem.current - problem.true_intercept - problem.true_coef * problem.previous
    assert stats.kstest(residuals.ravel(), stats.t(3.0).cdf).pvalue > 0.01
    # and not, say, Gaussian
    assert stats.kstest(residuals.ravel(), stats.norm(0, residuals.std()).cdf).pvalue < 1e-6


def test_fed_pdmc_lgcp_precision_and_spatial_owners():
    problem = datasets.fed_pdmc_lgcp(0, grid_size=4, alpha=0.1, beta=2.0)
    g = 4
    assert problem.counts.shape == (16,) and problem.precision.shape == (16, 16)
    for k in range(16):
        for n in range(16):
            (i, j), (a, b) = problem.coords[k], problem.coords[n]
            neighbours = abs(i - a) + abs(j - b) == 1
            assert problem.adjacency[k, n] == float(neighbours)
            expected = 2.0 if k == n else (-0.2 if neighbours else 0.0)
            assert problem.precision[k, n] == pytest.approx(expected)
    np.testing.assert_array_equal(problem.coords[:, 0] * g + problem.coords[:, 1], np.arange(16))
    # four 2 x 2 blocks of neighbouring cells, one client each
    np.testing.assert_array_equal(problem.owner.reshape(g, g), [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]])
    nine = datasets.fed_pdmc_lgcp(0, grid_size=6, blocks_per_side=3)
    assert np.bincount(nine.owner).tolist() == [4] * 9
    assert np.all(problem.counts >= 0) and np.all(problem.counts == np.round(problem.counts))
    np.testing.assert_array_equal(datasets.fed_pdmc_lgcp(0, beta=2.0).counts, problem.counts)
    with pytest.raises(ValueError, match="alpha"):
        datasets.fed_pdmc_lgcp(0, alpha=0.5)
    with pytest.raises(ValueError, match="divide"):
        datasets.fed_pdmc_lgcp(0, grid_size=5)


def test_fed_pdmc_lgcp_follows_the_model():
    # on a large grid the latent field has the prior's covariance and the counts their
    # Poisson means E y_k = exp(Sigma_kk / 2)
    problem = datasets.fed_pdmc_lgcp(3, grid_size=60, alpha=0.2, beta=4.0)
    covariance = np.linalg.inv(problem.precision)
    whitened = np.linalg.cholesky(problem.precision).T @ problem.latent
    assert stats.kstest(whitened, stats.norm.cdf).pvalue > 0.01
    assert stats.kstest(problem.latent / np.sqrt(np.diag(covariance)), stats.norm.cdf).pvalue > 0.001
    expected = np.exp(np.diag(covariance) / 2)
    residuals = (problem.counts - np.exp(problem.latent)) / np.sqrt(np.exp(problem.latent))
    assert abs(residuals.mean()) < 4 / np.sqrt(residuals.size)
    assert problem.counts.mean() == pytest.approx(expected.mean(), rel=0.1)


# --------------------------------------------------------------------------
# D-ADMMS generators


def negative_log_posterior(problem, x):
    """Sum over agents of f_i in D-ADMMS Eq. (27)."""
    num_agents = problem.owner.max() + 1
    total = 0.0
    for agent in range(num_agents):
        rows = problem.owner == agent
        residual = problem.y[rows] - problem.X[rows] @ x
        total += residual @ residual / (2 * problem.noise_std**2) + x @ x / (2 * problem.prior_variance * num_agents)
    return total


def test_dadmms_linear_exact_posterior():
    problem = datasets.dadmms_linear(0, num_agents=5, n_per_agent=50)
    assert problem.X.shape == (250, 2)
    assert problem.noise_std == 4.0 and problem.prior_variance == 10.0
    assert datasets.dadmms_linear(0, 5, 50).owner.tolist() == np.repeat(np.arange(5), 50).tolist()
    # posterior mean = ridge solution with penalty xi^2 / lambda
    ridge = Ridge(alpha=16.0 / 10.0, fit_intercept=False).fit(problem.X, problem.y)
    np.testing.assert_allclose(problem.posterior_mean, ridge.coef_, rtol=1e-8)
    # posterior precision = Hessian of Eq. (27), by central differences (exact for a quadratic)
    step = 1e-2
    hessian = np.empty((2, 2))
    mode = problem.posterior_mean
    for i in range(2):
        for j in range(2):
            e_i, e_j = np.eye(2)[i] * step, np.eye(2)[j] * step
            hessian[i, j] = (
                negative_log_posterior(problem, mode + e_i + e_j)
                - negative_log_posterior(problem, mode + e_i - e_j)
                - negative_log_posterior(problem, mode - e_i + e_j)
                + negative_log_posterior(problem, mode - e_i - e_j)
            ) / (4 * step**2)
    np.testing.assert_allclose(np.linalg.inv(problem.posterior_cov), hessian, rtol=1e-6)


def test_dadmms_linear_data_model():
    problem = datasets.dadmms_linear(3, num_agents=100, n_per_agent=200)
    residuals = problem.y - problem.X @ problem.true_coef
    assert residuals.std() == pytest.approx(4.0, rel=0.02)
    np.testing.assert_allclose(problem.X.std(axis=0), 1.0, rtol=0.02)
    # the true coefficients are a draw from the N(0, 10 I) prior
    draws = np.array([datasets.dadmms_linear(s, 1, 1).true_coef for s in range(500)]).ravel()
    assert draws.var() == pytest.approx(10.0, rel=0.15)


def test_dadmms_logistic_data_model():
    problem = datasets.dadmms_logistic(0, num_agents=100, n_per_agent=200)
    assert problem.X.shape == (20_000, 3) and problem.prior_variance == 10.0
    assert problem.owner.tolist() == np.repeat(np.arange(100), 200).tolist()
    np.testing.assert_allclose(problem.X.var(axis=0), 20.0, rtol=0.05)
    # labels are Bernoulli(sigmoid(x^T z)): compare frequencies with probabilities in bins
    prob = special.expit(problem.X @ problem.true_coef)
    bins = np.digitize(prob, np.linspace(0, 1, 11)[1:-1])
    for b in np.unique(bins):
        in_bin = bins == b
        if in_bin.sum() > 300:
            assert abs(problem.y[in_bin].mean() - prob[in_bin].mean()) < 4 * 0.5 / math.sqrt(in_bin.sum())
    draws = np.array([datasets.dadmms_logistic(s, 1, 1).true_coef for s in range(400)]).ravel()
    assert draws.var() == pytest.approx(10.0, rel=0.15)


def test_generator_argument_errors():
    with pytest.raises(ValueError, match="num_agents must be >= 1"):
        datasets.dadmms_linear(0, num_agents=0)
    with pytest.raises(ValueError, match="noise_std must be a finite number > 0"):
        datasets.dadmms_linear(0, noise_std=-1.0)
    with pytest.raises(TypeError, match="n_per_agent must be an integer"):
        datasets.dadmms_logistic(0, n_per_agent=2.5)
    with pytest.raises(ValueError, match="df must be a finite number > 0"):
        datasets.student_t_ar1(0, df=0.0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        datasets.fed_pdmc_logistic(0, n=0)


# --------------------------------------------------------------------------
# DSVGD mixture toy


@pytest.mark.parametrize("prior", ["gaussian", "uniform"])
def test_dsvgd_mixture_posterior_is_normalised_product(prior):
    toy = datasets.dsvgd_mixture_1d(prior)
    grid = np.linspace(-12, 12, 24_001)
    log_posterior = toy.log_posterior(grid)
    assert trapezoid(np.exp(log_posterior), grid) == pytest.approx(1.0, abs=1e-4)
    # independently: prior x N(1, 4) x (N(-3, 1) + N(3, 2)), normalised on the grid
    unnormalised = (
        stats.norm(1, 2).pdf(grid)
        * (stats.norm(-3, 1).pdf(grid) + stats.norm(3, math.sqrt(2)).pdf(grid))
        * (stats.norm(0, 1).pdf(grid) if prior == "gaussian" else (np.abs(grid) <= 6) / 12.0)
    )
    reference = unnormalised / trapezoid(unnormalised, grid)
    np.testing.assert_allclose(np.exp(log_posterior), reference, atol=1e-4)
    # the same through the toy's own factors
    composed = toy.log_prior(grid) + toy.local_log_likelihood(0, grid) + toy.local_log_likelihood(1, grid)
    composed = np.exp(composed - composed.max())
    np.testing.assert_allclose(composed / trapezoid(composed, grid), reference, atol=1e-4)
    # exact sampler and exact mean agree with the grid
    grid_mean = trapezoid(grid * reference, grid)
    assert toy.posterior.mean() == pytest.approx(grid_mean, abs=1e-4)
    assert toy.posterior.sample(50_000, seed=0).mean() == pytest.approx(grid_mean, abs=0.03)


def test_dsvgd_mixture_uniform_prior_is_truncated():
    toy = datasets.dsvgd_mixture_1d("uniform")
    assert toy.support == (-6.0, 6.0)
    assert np.all(np.isneginf(toy.log_posterior(np.array([-6.5, 7.0]))))
    draws = toy.posterior.sample(10_000, seed=1)
    assert draws.min() >= -6.0 and draws.max() <= 6.0
    with pytest.raises(ValueError, match="prior must be 'gaussian' or 'uniform'"):
        datasets.dsvgd_mixture_1d("flat")
    with pytest.raises(ValueError, match="agent must be < 2"):
        toy.local_log_likelihood(2, 0.0)
