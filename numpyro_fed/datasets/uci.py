"""Loaders of the real data sets (UCI Adult, kin8nm, protein).

They take the path of the files: the package never assumes where data lives. They return a
frozen :class:`Dataset` of numpy float arrays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from numpyro_fed._checks import check_real as _check_real

__all__ = [
    "ADULT_CATEGORICAL_COLUMNS",
    "ADULT_NUMERIC_COLUMNS",
    "Dataset",
    "load_adult",
    "load_kin8nm",
    "load_protein",
]


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split of a real data set.

    ``X_*`` are float arrays ``(n, p)`` and ``y_*`` float arrays ``(n,)``.
    For regression sets ``y`` is standardised with the training split's
    statistics; undo with ``y * y_std + y_mean`` (so an RMSE on the
    standardised scale times ``y_std`` is the RMSE in original units). For
    classification sets ``y_mean`` and ``y_std`` are ``None``.
    """

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    feature_names: tuple[str, ...]
    y_mean: float | None = None
    y_std: float | None = None
    name: str = ""

    @property
    def num_features(self) -> int:
        return self.X_train.shape[1]


def _check_test_fraction(test_fraction) -> float:
    test_fraction = _check_real(test_fraction, "test_fraction")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    return test_fraction


def _train_test_rows(n: int, test_fraction: float, seed) -> tuple[np.ndarray, np.ndarray]:
    num_test = int(round(test_fraction * n))
    if not 0 < num_test < n:
        raise ValueError(f"test_fraction={test_fraction} leaves an empty split of {n} rows")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[num_test:]), np.sort(perm[:num_test])


def _standardise(train: np.ndarray, test: np.ndarray):
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    # A constant training column would divide by zero; centring it is enough.
    std = np.where(std > 0, std, 1.0)
    return (train - mean) / std, (test - mean) / std, mean, std


def _require_file(path) -> str:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path!r}")
    return path


def _resolve_file(path, filename: str) -> str:
    """``path`` is the file itself or the folder holding ``filename``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, filename)
    return _require_file(path)


#: Numeric Adult columns (index in the raw file, name); standardised.
ADULT_NUMERIC_COLUMNS: tuple[tuple[int, str], ...] = (
    (0, "age"),
    (2, "fnlwgt"),
    (4, "education-num"),
    (10, "capital-gain"),
    (11, "capital-loss"),
    (12, "hours-per-week"),
)

#: Categorical Adult columns (index in the raw file, name); one-hot encoded.
ADULT_CATEGORICAL_COLUMNS: tuple[tuple[int, str], ...] = (
    (1, "workclass"),
    (3, "education"),
    (5, "marital-status"),
    (6, "occupation"),
    (7, "relationship"),
    (8, "race"),
    (9, "sex"),
    (13, "native-country"),
)

_ADULT_NUM_FIELDS = 15


def _read_adult_rows(path: str) -> list[list[str]]:
    rows = []
    with open(path, newline="") as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.strip()
            # adult.test opens with "|1x3 Cross validator"; both files end in blank lines.
            if not line or line.startswith("|"):
                continue
            fields = [value.strip() for value in line.split(",")]
            if len(fields) != _ADULT_NUM_FIELDS:
                raise ValueError(
                    f"{path}:{line_number}: expected {_ADULT_NUM_FIELDS} comma-separated fields, got {len(fields)}"
                )
            rows.append(fields)
    return rows


def load_adult(path, *, test_fraction: float = 0.2, seed=0) -> Dataset:
    """UCI Adult ("Census Income"), the usual federated-VI preprocessing.

    Both original files are concatenated (48,842 rows) and split at random
    into train/test with ``seed``. The 6 numeric columns
    (:data:`ADULT_NUMERIC_COLUMNS`) are standardised with the training
    split's mean and standard deviation; the 8 categorical columns
    (:data:`ADULT_CATEGORICAL_COLUMNS`) are one-hot encoded over the
    categories seen in either file (sorted), keeping the missing value ``?``
    as a category of its own. Label ``1`` is ``>50K`` (about 23.9 % of rows).
    Features are ordered numeric first, then the one-hot blocks; one-hot
    feature names read ``"column=category"``.

    :param path: folder holding ``adult.data`` and ``adult.test``.
    :param test_fraction: fraction of rows in the test split.
    :param seed: seed of the random split.
    :returns: :class:`Dataset` with 108 features for the original files.
    :raises FileNotFoundError: naming the missing file.

    On the original files the training split is 39,074 x 108 with 24 %
    positive labels. The example writes two tiny files in the original
    format (``adult.test`` opens with a ``|1x3 Cross validator`` line and
    its labels end in a full stop) and loads them:

    >>> import os, shutil, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> def person(age, sex, label):
    ...     return (f"{age}, Private, 77516, Bachelors, 13, Never-married, Sales, "
    ...             f"Not-in-family, White, {sex}, 0, 0, 40, ?, {label}")
    >>> with open(os.path.join(folder, "adult.data"), "w") as f:
    ...     _ = f.write("\\n".join([person(39, "Male", "<=50K"), person(50, "Female", ">50K")]))
    >>> with open(os.path.join(folder, "adult.test"), "w") as f:
    ...     _ = f.write("\\n".join(["|1x3 Cross validator", person(25, "Female", "<=50K."),
    ...                             person(44, "Male", ">50K.")]))
    >>> data = load_adult(folder, test_fraction=0.25)
    >>> data.X_train.shape, data.X_test.shape, data.feature_names[-3:]
    ((3, 15), (1, 15), ('sex=Female', 'sex=Male', 'native-country=?'))
    >>> int(data.y_train.sum() + data.y_test.sum())  # '>50K' and '>50K.'
    2
    >>> shutil.rmtree(folder)
    """
    test_fraction = _check_test_fraction(test_fraction)
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Adult folder not found: {folder!r} (expected adult.data and adult.test in it)")
    rows = []
    for filename in ("adult.data", "adult.test"):
        rows.extend(_read_adult_rows(_require_file(os.path.join(folder, filename))))

    labels = [row[14].rstrip(".") for row in rows]
    unknown = sorted(set(labels) - {">50K", "<=50K"})
    if unknown:
        raise ValueError(f"unexpected Adult labels {unknown}; expected '>50K' or '<=50K'")
    y = np.array([label == ">50K" for label in labels], dtype=float)

    numeric = np.array([[float(row[i]) for i, _ in ADULT_NUMERIC_COLUMNS] for row in rows])
    one_hot_blocks = []
    feature_names = [name for _, name in ADULT_NUMERIC_COLUMNS]
    for column, name in ADULT_CATEGORICAL_COLUMNS:
        values = np.array([row[column] for row in rows])
        categories, codes = np.unique(values, return_inverse=True)
        one_hot_blocks.append(np.eye(categories.size)[codes])
        feature_names.extend(f"{name}={category}" for category in categories)
    categorical = np.concatenate(one_hot_blocks, axis=1)

    train, test = _train_test_rows(len(rows), test_fraction, seed)
    numeric_train, numeric_test, _, _ = _standardise(numeric[train], numeric[test])
    return Dataset(
        X_train=np.concatenate([numeric_train, categorical[train]], axis=1),
        y_train=y[train],
        X_test=np.concatenate([numeric_test, categorical[test]], axis=1),
        y_test=y[test],
        feature_names=tuple(feature_names),
        name="adult",
    )


def _load_regression(path, filename, num_columns, feature_names, name, test_fraction, seed) -> Dataset:
    test_fraction = _check_test_fraction(test_fraction)
    table = np.loadtxt(_resolve_file(path, filename), dtype=float, ndmin=2)
    if table.shape[1] != num_columns:
        raise ValueError(
            f"{name}: expected {num_columns} whitespace-separated columns (features then target), got {table.shape[1]}"
        )
    X, y = table[:, :-1], table[:, -1]
    train, test = _train_test_rows(len(table), test_fraction, seed)
    X_train, X_test, _, _ = _standardise(X[train], X[test])
    y_train, y_test, y_mean, y_std = _standardise(y[train], y[test])
    return Dataset(
        X_train=X_train,
        y_train=y_train,
        X_test=X_test,
        y_test=y_test,
        feature_names=tuple(feature_names),
        y_mean=float(y_mean),
        y_std=float(y_std),
        name=name,
    )


def load_kin8nm(path, *, test_fraction: float = 0.1, seed=0) -> Dataset:
    """kin8nm robot-arm kinematics regression (DELVE), 8,192 rows.

    Eight inputs, target in the last column. ``X`` and ``y`` are standardised
    with the training split's statistics; ``y_mean``/``y_std`` undo it.

    :param path: ``kin8nm.txt`` or the folder holding it.
    :param test_fraction: fraction of rows in the test split.
    :param seed: seed of the random split.
    :raises FileNotFoundError: if the file is missing.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> np.savetxt(os.path.join(folder, "kin8nm.txt"), np.random.default_rng(0).normal(size=(20, 9)))
    >>> data = load_kin8nm(folder)
    >>> data.X_train.shape, data.X_test.shape, data.feature_names[0]
    ((18, 8), (2, 8), 'theta1')
    """
    names = [f"theta{i}" for i in range(1, 9)]
    return _load_regression(path, "kin8nm.txt", 9, names, "kin8nm", test_fraction, seed)


def load_protein(path, *, test_fraction: float = 0.1, seed=0) -> Dataset:
    """UCI protein tertiary structure (CASP) regression, 45,730 rows.

    Nine features ``F1..F9``, RMSD target in the LAST column of
    ``protein_structure.txt`` (the UCI csv has it first). ``X`` and ``y`` are
    standardised with the training split's statistics; ``y_mean``/``y_std``
    undo it.

    :param path: ``protein_structure.txt`` or the folder holding it.
    :param test_fraction: fraction of rows in the test split.
    :param seed: seed of the random split.
    :raises FileNotFoundError: if the file is missing.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "protein_structure.txt")
    >>> np.savetxt(path, np.random.default_rng(0).uniform(size=(30, 10)))
    >>> data = load_protein(path, test_fraction=0.2)
    >>> data.X_train.shape, round(float(data.y_train.std()), 6)
    ((24, 9), 1.0)
    """
    names = [f"F{i}" for i in range(1, 10)]
    return _load_regression(path, "protein_structure.txt", 10, names, "protein", test_fraction, seed)
