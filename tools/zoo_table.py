"""Runs the model zoo and writes its table (docs/guide/zoo.md).

Every algorithm runs every model of ``tests/zoo/models.py`` with its default settings, each
run in a child process with a time budget (see ``tests/zoo/harness.py``). The outcomes go to
``benchmarks/results/zoo.json`` (git-ignored) and the table of ``docs/guide/zoo.md`` is
rewritten between its ``<!-- zoo-table -->`` markers.

    .venv/bin/python tools/zoo_table.py                # the full zoo (about 30-60 min on 2 cores)
    .venv/bin/python tools/zoo_table.py --jobs 1 --case gaussian_mean --algorithm DSVGD
    .venv/bin/python tools/zoo_table.py --from-json    # rewrite the page from the last run
    .venv/bin/python tools/zoo_table.py --tier real    # the real-model tier (tests/zoo/real_models.py)

``--case`` / ``--algorithm`` / ``--dtype`` re-run a selection and merge it into the JSON. The
real tier (published models on real data, committed NUTS references) writes
``benchmarks/results/zoo-real.json`` and its own table, between ``<!-- zoo-real-table -->``
markers of the same page.
The package under test is a clean ``git worktree`` of ``--commit`` (default ``HEAD``), so
uncommitted edits never reach the table; ``--commit working-tree`` runs the files as they are.
"""

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from zoo import harness, models  # noqa: E402
from zoo.worker import ALGORITHMS, REAL_RUN_LENGTHS, RUN_LENGTHS  # noqa: E402

RESULTS = {
    "synthetic": os.path.join(REPO, "benchmarks", "results", "zoo.json"),
    "real": os.path.join(REPO, "benchmarks", "results", "zoo-real.json"),
}
PAGE = os.path.join(REPO, "docs", "guide", "zoo.md")
MARKERS = {
    "synthetic": ("<!-- zoo-table -->", "<!-- /zoo-table -->"),
    "real": ("<!-- zoo-real-table -->", "<!-- /zoo-real-table -->"),
}
SYMBOL = {"agrees": "agrees", "warns": "**warns**", "refuses": "refuses", "FAILS": "**FAILS**"}


def run_all(selection, jobs, save=lambda results: None):
    refs = {}
    for case, algorithm, _ in selection:  # references first, one at a time (NUTS, cached)
        if case not in refs and _needs_ref(case, algorithm):
            print(f"reference of {case}", flush=True)
            refs[case] = harness.reference(case)
    results = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(harness.run_case, c, a, d, ref=refs.get(c)): (c, a, d) for c, a, d in selection}
        for future in concurrent.futures.as_completed(futures):
            outcome = future.result()
            print(outcome.report(), flush=True)
            results.append(dataclasses.asdict(outcome))
            save(results)  # a partial table survives an interrupted run
    return results


def _needs_ref(case_name, algorithm):
    case = models.get_case(case_name)
    return not (case.local_sites and algorithm in harness.GLOBAL_ONLY and case.tier == "synthetic")


def reclassify(run):
    """The run classified again from its stored record (after a change of the harness's rules)."""
    raw = run.get("raw")
    if not raw:
        return run
    ref = harness.reference(run["case"]) if _needs_ref(run["case"], run["algorithm"]) else None
    outcome = harness.classify(
        run["case"],
        run["algorithm"],
        run["dtype"],
        raw["record"],
        raw["seconds"],
        raw["timed_out"],
        raw["stderr"],
        raw["budget"],
        ref,
    )
    return dict(dataclasses.asdict(outcome), commit=run.get("commit"))


def _git(*args):
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


class _Checkout:
    """A detached worktree of ``commit`` whose ``numpyro_fed`` the zoo's children import."""

    def __init__(self, commit):
        self.sha = _git("rev-parse", "--short", commit)
        self.path = os.path.join("/tmp", f"wt-zoo-{self.sha}")

    def __enter__(self):
        if not os.path.isdir(self.path):
            _git("worktree", "add", "--detach", self.path, self.sha)
        os.environ["ZOO_PACKAGE_PATH"] = self.path
        return self

    def __exit__(self, *exc):
        os.environ.pop("ZOO_PACKAGE_PATH", None)
        _git("worktree", "remove", "--force", self.path)


def _cases(tier):
    if tier == "real":
        from zoo.real_models import REAL_CASES

        return list(REAL_CASES.values())
    return list(models.CASES.values())


def table(record, tier="synthetic") -> str:
    runs = {(r["case"], r["algorithm"], r["dtype"]): r for r in record["runs"]}
    lines = [
        "| model | what it stresses | reference | " + " | ".join(ALGORITHMS) + " |",
        "|---|---|---|" + "---|" * len(ALGORITHMS),
    ]
    notes = []
    both = ("float64", "float32") if tier == "real" else ("float32", "float64")
    for case in _cases(tier):
        for dtype in both if case.float64 else ("float32",):
            cells = []
            for algorithm in ALGORITHMS:
                r = runs.get((case.name, algorithm, dtype))
                if r is None:
                    cells.append("not run")
                    continue
                seconds = "" if r["seconds"] is None else f" ({r['seconds']:.0f} s)"
                mark = ""
                if r["outcome"] != "agrees" or r["warnings"]:
                    notes.append(r)
                    mark = f" [{len(notes)}]"
                cells.append(SYMBOL[r["outcome"]] + seconds + mark)
            ref = "closed form" if case.closed_form is not None else "NUTS"
            if tier == "real" and all(runs.get((case.name, a, dtype)) is None for a in ALGORITHMS):
                continue  # not run yet: the table says so below
            issue = f" ({case.issue})" if case.issue else ""
            lines.append(f"| `{case.name}` {dtype}{issue} | {case.what} | {ref} | " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    if notes:
        out += "\n"
        for i, r in enumerate(notes, 1):
            text = r["detail"].replace("\n", " ").replace("|", "/")
            out += f"{i}. {r['case']} x {r['algorithm']} ({r['dtype']}), {r['outcome']}: {text}"
            if r["warnings"]:
                out += " Warnings: " + "; ".join(w.replace("\n", " ")[:300] for w in r["warnings"])
            out += "\n"
    commits = {}
    for r in record["runs"]:
        commits.setdefault(r.get("commit", record["commit"]), set()).add(r["algorithm"])
    where = "; ".join(f"{', '.join(a for a in ALGORITHMS if a in algs)} at `{c}`" for c, algs in commits.items())
    command = "`.venv/bin/python tools/zoo_table.py" + (" --tier real`" if tier == "real" else "`")
    out += (
        f"\nGenerated ({where}) on {record['date']} by {command} (run times on a shared 2-core "
        "machine, in the child process, compilation included).\n"
    )
    if tier == "real":  # a partial run says how far it got
        coverage = []
        for m in sorted({c.num_clients for c in _cases(tier)}):
            for d in ("float64", "float32"):
                cells = [(c.name, a, d) for c in _cases(tier) if c.num_clients == m for a in ALGORITHMS]
                coverage.append(f"{m} clients {d}: {sum(cell in runs for cell in cells)} of {len(cells)}")
        out += "\nCells run (rows with none are left out): " + "; ".join(coverage) + ".\n"
    return out


def write_page(record, tier="synthetic"):
    begin, end_marker = MARKERS[tier]
    with open(PAGE) as f:
        text = f.read()
    start, end = text.index(begin) + len(begin), text.index(end_marker)
    with open(PAGE, "w") as f:
        f.write(text[:start] + "\n" + table(record, tier) + text[end:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--case", action="append")
    parser.add_argument("--algorithm", action="append", choices=ALGORITHMS)
    parser.add_argument("--dtype", action="append", choices=("float32", "float64"))
    parser.add_argument("--from-json", action="store_true", help="only rewrite the page from the last run")
    parser.add_argument("--commit", default="HEAD", help="the commit under test, or 'working-tree'")
    parser.add_argument("--tier", default="synthetic", choices=("synthetic", "real"))
    args = parser.parse_args()
    results_path = RESULTS[args.tier]
    if args.from_json:
        with open(results_path) as f:
            record = json.load(f)
        record["runs"] = [reclassify(r) for r in record["runs"]]
        with open(results_path, "w") as f:
            json.dump(record, f, indent=1)
        write_page(record, args.tier)
        return
    selection = [
        (c, a, d)
        for c, a, d in harness.all_runs(args.tier)
        if (not args.case or c in args.case)
        and (not args.algorithm or a in args.algorithm)
        and (not args.dtype or d in args.dtype)
    ]
    old = []
    if (args.case or args.algorithm or args.dtype) and os.path.exists(results_path):
        with open(results_path) as f:
            previous = json.load(f)
        old = [dict(r, commit=r.get("commit", previous["commit"])) for r in previous["runs"]]
    if args.case or args.algorithm or args.dtype:
        # the page is rewritten from the selected runs and the JSON's others: without every other
        # cell in the JSON (it is not in git; a fresh checkout has none) the table would lose them
        missing = (
            set(harness.all_runs(args.tier)) - set(selection) - {(r["case"], r["algorithm"], r["dtype"]) for r in old}
        )
        if missing:
            raise SystemExit(
                f"zoo_table: --case/--algorithm/--dtype re-run part of the table, whose other cells come from "
                f"{os.path.relpath(results_path, REPO)}, which lacks {len(missing)} of them (e.g. "
                f"{sorted(missing)[0]}): run the whole tier, or copy the JSON of the last full run there"
            )
    commit = _git("rev-parse", "--short", "HEAD") + " + uncommitted edits"

    def save(results):
        for r in results:
            r.setdefault("commit", commit)
        keys = {(r["case"], r["algorithm"], r["dtype"]) for r in results}
        record = {
            "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "run_lengths": REAL_RUN_LENGTHS if args.tier == "real" else RUN_LENGTHS,
            "runs": [r for r in old if (r["case"], r["algorithm"], r["dtype"]) not in keys] + results,
        }
        os.makedirs(os.path.dirname(results_path), exist_ok=True)
        with open(results_path, "w") as f:
            json.dump(record, f, indent=1)
        write_page(record, args.tier)

    if args.commit == "working-tree":
        results = run_all(selection, args.jobs, save)
    else:
        with _Checkout(args.commit) as checkout:
            commit = checkout.sha
            print(f"testing numpyro_fed at {commit} ({checkout.path})", flush=True)
            results = run_all(selection, args.jobs, save)
    failures = [r for r in results if r["outcome"] == "FAILS"]
    print(
        f"{len(results)} runs: "
        + ", ".join(f"{k} {sum(r['outcome'] == k for r in results)}" for k in ("agrees", "warns", "refuses", "FAILS"))
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
