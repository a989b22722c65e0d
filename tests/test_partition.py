"""Client splits: sizes, coverage, the DP-PVI paper's Table 2, argument checks."""

import numpy as np
import pytest

from numpyro_fed import partition

# Adult as split in DP-PVI (Heikkilä et al. 2023), Table 2: n = 24420 rows,
# majority fraction shown as .76. 18520 / 24420 = 0.7584 is a majority count
# for which every lambda in Table 2 rounds to the printed value.
TABLE2_N = 24420
TABLE2_MAJORITY = 18520


def table2_labels(seed=0):
    labels = np.r_[np.zeros(TABLE2_MAJORITY), np.ones(TABLE2_N - TABLE2_MAJORITY)]
    return np.random.default_rng(seed).permutation(labels)


def assert_valid_owner(owner, n, num_clients):
    assert owner.shape == (n,)
    assert owner.dtype.kind in "iu"
    assert owner.min() == 0 and owner.max() == num_clients - 1
    assert np.all(np.bincount(owner, minlength=num_clients) >= 1)


# --------------------------------------------------------------------------
# even


@pytest.mark.parametrize("n, num_clients", [(10, 3), (7, 7), (100, 1), (101, 10)])
def test_even_matches_array_split(n, num_clients):
    owner = partition.even(n, num_clients)
    assert_valid_owner(owner, n, num_clients)
    expected = [len(block) for block in np.array_split(np.arange(n), num_clients)]
    assert partition.client_sizes(owner).tolist() == expected
    # contiguous: ids never decrease along the rows
    assert np.all(np.diff(owner) >= 0)


def test_even_shuffle_keeps_sizes_and_is_seeded():
    plain = partition.even(50, 4)
    shuffled = partition.even(50, 4, shuffle=True, seed=1)
    assert partition.client_sizes(shuffled).tolist() == partition.client_sizes(plain).tolist()
    assert not np.array_equal(shuffled, plain)
    assert np.array_equal(shuffled, partition.even(50, 4, shuffle=True, seed=1))
    assert not np.array_equal(shuffled, partition.even(50, 4, shuffle=True, seed=2))


def test_even_errors():
    with pytest.raises(ValueError, match="num_clients=5 exceeds the number of rows n=4"):
        partition.even(4, 5)
    with pytest.raises(ValueError, match="num_clients must be >= 1"):
        partition.even(4, 0)
    with pytest.raises(TypeError, match="num_clients must be an integer"):
        partition.even(4, 2.0)
    with pytest.raises(TypeError, match="n must be an integer"):
        partition.even(True, 1)


# --------------------------------------------------------------------------
# by_label


@pytest.mark.parametrize(
    "split, n_small, small_fraction, large_fraction",
    [
        # Table 2 of the DP-PVI paper: rho, kappa -> n_small, lambda_small, lambda_large
        ("balanced", 2442, 0.76, 0.76),
        ("unbalanced1", 610, 0.99, 0.73),
        ("unbalanced2", 732, 0.03, 0.89),
    ],
)
def test_by_label_reproduces_dppvi_table2(split, n_small, small_fraction, large_fraction):
    labels = table2_labels()
    majority = labels == 0
    rho, kappa = partition.DPPVI_SPLITS[split]
    owner = partition.by_label(labels, 10, rho=rho, kappa=kappa, seed=0)
    assert_valid_owner(owner, TABLE2_N, 10)

    sizes = partition.client_sizes(owner)
    assert sizes[:5].tolist() == [n_small] * 5
    n_large = int(np.floor(TABLE2_N / 10 * (1 + rho) + 1e-9))
    assert np.all(sizes[5:] >= n_large) and np.all(sizes[5:] <= n_large + 1)
    assert sizes.sum() == TABLE2_N

    for client in range(5):
        assert round(majority[owner == client].mean(), 2) == small_fraction
    assert round(majority[owner >= 5].mean(), 2) == large_fraction
    # "For large clients the labels are divided randomly": each is near the pool's rate.
    for client in range(5, 10):
        assert abs(majority[owner == client].mean() - large_fraction) < 0.03


@pytest.mark.parametrize("split, n_small", [("balanced", 122), ("unbalanced1", 30), ("unbalanced2", 36)])
def test_by_label_reproduces_dppvi_table3_sizes(split, n_small):
    rho, kappa = partition.DPPVI_SPLITS[split]
    owner = partition.by_label(table2_labels(), 200, rho=rho, kappa=kappa, seed=0)
    assert_valid_owner(owner, TABLE2_N, 200)
    assert np.all(partition.client_sizes(owner)[:100] == n_small)


def test_by_label_small_client_majority_count_follows_formula():
    labels = table2_labels()
    lam = TABLE2_MAJORITY / TABLE2_N
    owner = partition.by_label(labels, 10, rho=0.75, kappa=0.95, seed=3)
    expected = round((lam + (1 - lam) * 0.95) * 610)
    for client in range(5):
        assert np.sum(labels[owner == client] == 0) == expected


def test_by_label_clips_lambda_small_at_zero_and_one():
    labels = table2_labels()
    only_minority = partition.by_label(labels, 10, rho=0.75, kappa=-5.0, seed=0)
    only_majority = partition.by_label(labels, 10, rho=0.75, kappa=3.0, seed=0)
    for client in range(5):
        assert np.all(labels[only_minority == client] == 1)
        assert np.all(labels[only_majority == client] == 0)


def test_by_label_multiclass_and_string_labels():
    labels = np.repeat(np.array(["a", "b", "c"]), [60, 25, 15])
    owner = partition.by_label(labels, 4, rho=0.5, kappa=1.0, seed=0)
    assert_valid_owner(owner, 100, 4)
    assert np.all(labels[owner < 2] == "a")  # kappa = 1: small clients hold the majority class only


def test_by_label_odd_clients_without_imbalance():
    owner = partition.by_label(np.arange(31) % 2, 3, rho=0.0, kappa=0.0, seed=0)
    assert_valid_owner(owner, 31, 3)
    assert sorted(partition.client_sizes(owner).tolist()) == [10, 10, 11]


def test_by_label_is_seeded():
    labels = table2_labels()
    first = partition.by_label(labels, 10, rho=0.7, kappa=-3.0, seed=5)
    assert np.array_equal(first, partition.by_label(labels, 10, rho=0.7, kappa=-3.0, seed=5))
    assert not np.array_equal(first, partition.by_label(labels, 10, rho=0.7, kappa=-3.0, seed=6))


def test_by_label_errors():
    labels = table2_labels()
    with pytest.raises(ValueError, match=r"rho must lie in \[0, 1\]"):
        partition.by_label(labels, 10, rho=1.5, kappa=0.0)
    with pytest.raises(ValueError, match="rho=1.0 leaves the small clients"):
        partition.by_label(labels, 10, rho=1.0, kappa=0.0)
    with pytest.raises(ValueError, match="num_clients must be even when rho > 0"):
        partition.by_label(labels, 5, rho=0.5, kappa=0.0)
    with pytest.raises(ValueError, match="labels must be 1-D"):
        partition.by_label(labels.reshape(-1, 2), 10, rho=0.5, kappa=0.0)
    with pytest.raises(ValueError, match="kappa must be finite"):
        partition.by_label(labels, 10, rho=0.5, kappa=float("nan"))
    with pytest.raises(TypeError, match="rho must be a real number"):
        partition.by_label(labels, 10, rho="0.5", kappa=0.0)
    with pytest.raises(ValueError, match="num_clients=11 exceeds the number of rows n=10"):
        partition.by_label(np.zeros(10), 11, rho=0.0, kappa=0.0)
    # 10 rows with 2 minority rows: two small clients of 2 rows each cannot both be minority-only
    few_minority = np.r_[np.zeros(8), np.ones(2)]
    with pytest.raises(ValueError, match="kappa=-10.0 .* need 4 minority-class rows but labels hold only 2"):
        partition.by_label(few_minority, 4, rho=0.2, kappa=-10.0)
    # four classes: the two small clients (2 rows each) want 4 rows of the majority class, which has 3
    flat_classes = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    with pytest.raises(ValueError, match="kappa=1.0 .* need 4 majority-class rows but labels hold only 3"):
        partition.by_label(flat_classes, 4, rho=0.0, kappa=1.0, seed=0)


# --------------------------------------------------------------------------
# dirichlet


def test_dirichlet_covers_all_rows_and_respects_min_size():
    labels = np.repeat(np.arange(5), 200)
    owner = partition.dirichlet(labels, 10, alpha=0.3, seed=0, min_size=20)
    assert_valid_owner(owner, 1000, 10)
    assert partition.client_sizes(owner).min() >= 20


def test_dirichlet_alpha_controls_label_skew():
    labels = np.repeat(np.arange(4), 2500)

    def mean_label_entropy(alpha):
        owner = partition.dirichlet(labels, 8, alpha=alpha, seed=0)
        entropies = []
        for rows in partition.client_indices(owner):
            p = np.bincount(labels[rows], minlength=4) / rows.size
            entropies.append(-np.sum(p[p > 0] * np.log(p[p > 0])))
        return np.mean(entropies)

    # Near-iid clients have label entropy close to log 4; skewed ones far less.
    assert mean_label_entropy(1000.0) > 0.99 * np.log(4)
    assert mean_label_entropy(0.1) < 0.6 * np.log(4)


def test_dirichlet_per_class_counts_are_preserved():
    labels = np.repeat(np.arange(3), [100, 50, 10])
    owner = partition.dirichlet(labels, 4, alpha=1.0, seed=2)
    counts = np.zeros((4, 3), dtype=int)
    np.add.at(counts, (owner, labels), 1)
    assert counts.sum(axis=0).tolist() == [100, 50, 10]


def test_dirichlet_errors():
    labels = np.repeat(np.arange(2), 10)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        partition.dirichlet(labels, 2, alpha=0.0)
    with pytest.raises(ValueError, match="min_size=11 with num_clients=2 needs 22 rows"):
        partition.dirichlet(labels, 2, alpha=1.0, min_size=11)
    # One class, alpha -> 0: each draw gives (nearly) all rows to one client.
    with pytest.raises(ValueError, match="no draw in max_tries=3 gave every client min_size=10 rows"):
        partition.dirichlet(np.zeros(20), 2, alpha=0.01, seed=0, min_size=10, max_tries=3)
    with pytest.raises(ValueError, match="labels must not be empty"):
        partition.dirichlet([], 2, alpha=1.0)


# --------------------------------------------------------------------------
# owner-array utilities


def test_client_indices_partition_the_rows():
    owner = np.random.default_rng(0).integers(0, 6, size=300)
    indices = partition.client_indices(owner)
    assert len(indices) == 6
    for client, rows in enumerate(indices):
        assert np.array_equal(rows, np.flatnonzero(owner == client))
    assert np.array_equal(np.sort(np.concatenate(indices)), np.arange(300))


def test_client_indices_and_sizes_report_empty_clients():
    indices = partition.client_indices([0, 0, 2], num_clients=4)
    assert [rows.tolist() for rows in indices] == [[0, 1], [], [2], []]
    assert partition.client_sizes([0, 0, 2], num_clients=4).tolist() == [2, 0, 1, 0]


def test_owner_errors():
    with pytest.raises(TypeError, match="owner must hold integer client ids"):
        partition.client_sizes([0.0, 1.0])
    with pytest.raises(ValueError, match="owner must hold client ids >= 0"):
        partition.client_indices([0, -1])
    with pytest.raises(ValueError, match="owner must be a 1-D array"):
        partition.client_sizes([[0, 1]])
    with pytest.raises(ValueError, match="owner holds client id 3, outside 0..1"):
        partition.client_sizes([0, 3], num_clients=2)
