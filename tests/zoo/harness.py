"""Runs zoo cases in child processes under a time budget and classifies the outcome.

A jitted loop cannot be interrupted by a Python signal, so every run is a child process
(:mod:`zoo.worker`) killed when its budget is spent. Outcomes per (model, algorithm, dtype):

* ``agrees``: the run finished within its budget and matches the reference (:func:`compare`);
* ``warns``: it finished, does not match, and said so with a warning (an approximate
  algorithm only: an exact sampler, FedZigZag, that does not match FAILS, warning or not);
* ``refuses``: the package raised a worded error of its own (at construction, or a run
  stopped with the reason); on a model with client-local latents that an algorithm cannot
  handle by design, the message must name the site;
* ``FAILS``: wrong without a word, non-finite draws without a word, out of time (a hang),
  a crash, or an error from outside the package (e.g. a bare JAX shape error).

Tolerances (see :func:`compare`) come from Monte Carlo error: the per-coordinate mean
difference must lie within ``Z * sqrt(MCSE_alg^2 + MCSE_ref^2)``, and the log of the sd ratio
within ``Z`` standard errors of the two sd estimates, plus, for the approximate algorithms
(DADMMS, DSVGD, DPPVI), an allowance for their known approximation.
"""

import dataclasses
import hashlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from zoo import models
from zoo.worker import ALGORITHMS

ZOO_DIR = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(ZOO_DIR)
REPO_DIR = os.path.dirname(TESTS_DIR)
CACHE_DIR = os.path.join(REPO_DIR, "benchmarks", "results", "zoo")

# z of the tolerances: with about 1,000 (case, coordinate, statistic) checks in the full zoo,
# a false alarm rate of 6e-5 per check (two-sided normal tail at 4) keeps the zoo's false alarm
# probability near 6%; the estimated MCSEs are themselves noisy, which 4 (not 3.3) absorbs.
Z = 4.0
# Approximate algorithms: a mean within half a posterior sd and an sd within a factor 2 of the
# reference. DSVGD (20 particles, KDE-smoothed tilted targets) and DPPVI (a mean-field
# Gaussian) are variational; DADMMS's iterates carry the O(1/rho) bias of its Theorem 3 (its
# guide measures an iterate covariance about half the posterior's on the paper's regression).
# Half an sd keeps the 95% intervals overlapping by more than 80%; a factor 2 is the
# under-dispersion mean-field VI shows on moderately correlated posteriors.
APPROXIMATE = {"DADMMS", "DSVGD", "DPPVI"}
MEAN_ALLOWANCE_SD = 0.5
SD_RATIO_ALLOWANCE = 2.0
# DPPVI on a Gaussian posterior: its family holds the KL(q || p) optimum in closed form (the
# exact means; sds 1 / sqrt(diag(precision))), so a converged default run must land on it up to
# the noise of its stochastic local fits: means within 0.1 posterior sd, or within the 99%
# quantile of the largest of d such errors when d is large, sds within 10% (well-tuned runs
# reach 0.02-0.06 sd on the linear regression, item 6). That noise was measured on
# linear_d100 (10 default rounds, 6 seeds, float32): seed-to-seed sd of q's means 0.028
# posterior sd per coordinate (median; 0.054 at most), the mean over the seeds 0.038 sd from
# the optimum at worst (no bias), a single seed's worst coordinate 0.07-0.11 sd.
MEAN_FIELD_MEAN_SD = 0.1
MEAN_FIELD_NOISE_SD = 0.035
MEAN_FIELD_SD_RATIO = 1.1
# Exact samplers must reach this many effective draws on every coordinate for their MCSE (and
# so the comparison) to mean anything.
MIN_ESS = 20
# Children get this many seconds by default (compilation included); a case may take longer
# only by being slow, which is then a failure of the time budget.
DEFAULT_BUDGET = 300.0
REFERENCE_BUDGET = 1200.0
# Algorithms that leave client-local latent variables out by design: they must refuse them by
# name. None today: DSVGD moves joint particles (numpyro_fed.infer.stein.local), DPPVI keeps
# each client's q(z_m) as its state (numpyro_fed.infer.pvi.local).
GLOBAL_ONLY = set()
# Worded errors a package raises on purpose; anything else from its code (NameError, KeyError,
# IndexError, ...) is a crash.
REFUSALS = {"ValueError", "TypeError", "NotImplementedError", "RuntimeError", "FloatingPointError"}
IGNORED_WARNINGS = {
    "DeprecationWarning",
    "PendingDeprecationWarning",
    "FutureWarning",
    "TqdmWarning",
    "TqdmExperimentalWarning",
}
# Warnings that say nothing about the answer: ArviZ's guess at the layout of many short chains,
# JAX's note that float64 data were cast to float32.
IGNORED_MESSAGES = ("More chains (", "Explicitly requested dtype")


# -- the real-model tier (zoo.real_models) ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """What agreeing means on the real tier: every flat unconstrained coordinate's mean within
    ``mean_sd`` reference sds, its sd ratio within ``[1 / sd_ratio, sd_ratio]``, and (samplers)
    at least ``min_ess`` effective draws on every coordinate."""

    mean_sd: float
    sd_ratio: float
    min_ess: float = 0.0


# The targets of the real tier, per algorithm, in one place. The references' own Monte Carlo
# error is at most 0.03 sd on a mean (ESS >= 1000, tools/zoo_real_references.py). FedZigZag's
# 0.25 sd with at least 200 effective draws leaves 3.5 of its own Monte Carlo standard errors
# (0.07 sd at ESS 200) and its log sd ratio 4.8 (0.5 sqrt(2 / 200) = 0.05 against log 1.4);
# the approximate algorithms draw 2000 independent draws (MCSE 0.02 sd), so their tolerances
# are allowances for their approximation.
REAL_TOLERANCES = {
    "FedZigZag": Tolerance(mean_sd=0.25, sd_ratio=1.4, min_ess=200.0),
    "DADMMS": Tolerance(mean_sd=0.3, sd_ratio=1.4),
    "DSVGD": Tolerance(mean_sd=0.3, sd_ratio=1.5),
    "DPPVI": Tolerance(mean_sd=0.3, sd_ratio=1.5),
}
REAL_BUDGET = 600.0  # seconds per run: no run past 10 minutes on models of this size


def real_fingerprint(model_name: str) -> str:
    """A hash of what a real model's reference depends on: the model's code and its data."""
    from zoo import real_models

    model, args = real_models.MODELS[model_name].build(1)
    digest = hashlib.sha1(model_name.encode())
    digest.update(inspect.getsource(model).encode())
    for a in args:
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()[:12]


def real_reference(model_name: str) -> dict:
    """The committed NUTS reference of a real model (``tests/zoo/references/``); an error if it
    is missing or stale (its model or data changed since it was computed)."""
    from zoo import real_models

    path = real_models.MODELS[model_name].reference_path()
    remedy = f"run tools/zoo_real_references.py --model {model_name}"
    if not os.path.exists(path):
        raise RuntimeError(f"no NUTS reference for the real model {model_name}: {remedy}")
    with open(path) as f:
        record = json.load(f)
    if record["fingerprint"] != real_fingerprint(model_name):
        raise RuntimeError(f"the NUTS reference of {model_name} is stale (its model or data changed): {remedy}")
    summary = record["summary"]
    ref = {k: np.asarray(summary[k], dtype=np.float64) for k in ("mean", "sd", "ess_mean", "ess_sd", "kurtosis")}
    ref.update(kind="NUTS", coordinates=summary["coordinates"], divergences=record["divergences"])
    return ref


def compare_real(summary: dict, ref: dict, algorithm: str):
    """``(agrees, detail)`` under the real tier's targets (:data:`REAL_TOLERANCES`)."""
    tol = REAL_TOLERANCES[algorithm]
    mean, sd = np.asarray(summary["mean"]), np.asarray(summary["sd"])
    if mean.shape != ref["mean"].shape:
        return False, f"{mean.size} coordinates, the reference has {ref['mean'].size}"
    names, ess = summary["coordinates"], np.asarray(summary["ess_mean"])
    mean_err = np.abs(mean - ref["mean"]) / ref["sd"]
    log_ratio = np.log(np.maximum(sd, 1e-300) / ref["sd"])
    worst_mean, worst_sd = int(mean_err.argmax()), int(np.abs(log_ratio).argmax())
    detail = (
        f"worst mean {names[worst_mean]}: {mean[worst_mean]:.4g} vs {ref['mean'][worst_mean]:.4g} "
        f"({mean_err[worst_mean]:.2f} ref sd, tolerance {tol.mean_sd}); worst sd {names[worst_sd]}: ratio "
        f"{math.exp(log_ratio[worst_sd]):.3g} (tolerance x/÷ {tol.sd_ratio}); min ESS {ess.min():.0f}"
    )
    if tol.min_ess and ess.min() < tol.min_ess:
        return (
            False,
            f"too few effective draws: ESS {ess.min():.0f} < {tol.min_ess:.0f} on {names[int(ess.argmin())]}; "
            + detail,
        )
    agrees = mean_err.max() <= tol.mean_sd and np.abs(log_ratio).max() <= math.log(tol.sd_ratio)
    return bool(agrees), detail


@dataclasses.dataclass
class Outcome:
    case: str
    algorithm: str
    dtype: str
    outcome: str  # agrees / warns / refuses / FAILS
    detail: str
    seconds: float | None
    warnings: list
    raw: dict | None = None  # what classify() read, to classify again (tools/zoo_table.py --from-json)

    def report(self) -> str:
        lines = [f"{self.case} x {self.algorithm} ({self.dtype}): {self.outcome} -- {self.detail}"]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _child_env(x64: bool):
    env = dict(os.environ)
    env["JAX_ENABLE_X64"] = "1" if x64 else "0"
    # ZOO_PACKAGE_PATH: a checkout whose numpyro_fed the children import (tools/zoo_table.py
    # points it at a clean worktree of a commit); default: this repository's.
    package = env.get("ZOO_PACKAGE_PATH", REPO_DIR)
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, package, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run_child(argv, out_path, x64, budget):
    """``(record or None, seconds, timed_out, stderr tail)``; the child is killed at the budget."""
    start = time.perf_counter()
    try:
        env = _child_env(x64)
        # ``-m`` puts the working directory first on the path: the package's checkout
        proc = subprocess.run(
            [sys.executable, "-m", "zoo.worker", *argv],
            env=env,
            cwd=env.get("ZOO_PACKAGE_PATH", REPO_DIR),
            capture_output=True,
            text=True,
            timeout=budget,
        )
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - start, True, ""
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not os.path.exists(out_path):
        return None, seconds, False, (proc.stderr or "")[-1500:]
    with open(out_path) as f:
        return json.load(f), seconds, False, ""


# -- references ---------------------------------------------------------------------------------


def _case_fingerprint(case) -> str:
    """A hash of what the NUTS reference depends on: the model's code, its data, NUTS's settings."""
    model, args = case.build()
    key = f"{case.name}|{case.nuts!r}|{case.reference_draws}|{case.reference_model is not None}"
    digest = hashlib.sha1(key.encode())
    digest.update(inspect.getsource(model).encode())
    for a in args:
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()[:12]


def reference(case_name: str) -> dict:
    """``{"mean", "sd", "ess_mean", "ess_sd", "kurtosis", "coordinates"}``: closed form, or NUTS
    (run once in a child process, cached in ``benchmarks/results/zoo/`` under a fingerprint of
    the zoo's models)."""
    case = models.get_case(case_name)
    if case.tier == "real":
        return real_reference(case.real_model)
    if case.closed_form is not None:
        mean, sd = (np.asarray(v, dtype=np.float64) for v in case.closed_form())
        inf = np.full(mean.shape, np.inf)
        return {
            "kind": "closed form",
            "mean": mean,
            "sd": sd,
            "ess_mean": inf,
            "ess_sd": inf,
            "kurtosis": np.full(mean.shape, 3.0),
            "mean_field": None if case.mean_field is None else case.mean_field(),
        }
    os.makedirs(CACHE_DIR, exist_ok=True)
    path = os.path.join(CACHE_DIR, f"reference-{case_name}-{_case_fingerprint(case)}.json")
    if not os.path.exists(path):
        record, seconds, timed_out, stderr = _run_child(["reference", case_name, path], path, True, REFERENCE_BUDGET)
        if record is None:
            raise RuntimeError(
                f"the NUTS reference of {case_name} did not finish ({'timeout' if timed_out else 'crash'}): {stderr}"
            )
    with open(path) as f:
        record = json.load(f)
    summary = record["summary"]
    ref = {k: np.asarray(summary[k], dtype=np.float64) for k in ("mean", "sd", "ess_mean", "ess_sd", "kurtosis")}
    if ref["ess_mean"].min() < 400:
        raise RuntimeError(f"the NUTS reference of {case_name} is too noisy: min ESS {ref['ess_mean'].min():.0f}")
    ref.update(kind="NUTS", coordinates=summary["coordinates"], divergences=record["divergences"])
    return ref


# -- comparison ---------------------------------------------------------------------------------


def _sd_log_se(sd_ess, kurtosis):
    """Standard error of log(sd): the variance estimator's relative error is
    sqrt((kurtosis - 1) / ESS) (ESS of the squared deviations), half of it for the sd."""
    return 0.5 * np.sqrt(np.maximum(kurtosis - 1.0, 0.5) / sd_ess)


def compare_mean_field(q: dict, mean_field, ref_sd, ref_mean=None):
    """``(agrees, detail)``: DPPVI's fitted ``q`` against its family's optimum: the best
    mean-field Gaussian, or, for a full-rank ``q`` (``q["full_rank"]``), the Gaussian posterior
    itself (``ref_mean``, ``ref_sd``: the closed form), whose marginal sds its ``scale`` holds."""
    loc, scale = np.asarray(q["loc"]), np.asarray(q["scale"])
    full_rank = bool(q.get("full_rank")) and ref_mean is not None
    if full_rank:
        mean, sd = np.asarray(ref_mean, dtype=np.float64), np.asarray(ref_sd, dtype=np.float64)
    else:
        mean, sd = (np.asarray(v, dtype=np.float64) for v in mean_field)
    mean_err = np.abs(loc - mean) / ref_sd
    ratio = scale / sd
    # the 99% quantile of the largest |error| over d coordinates of noise MEAN_FIELD_NOISE_SD
    z = statistics.NormalDist().inv_cdf(0.5 * (1.0 + 0.99 ** (1.0 / loc.size)))
    mean_tol = max(MEAN_FIELD_MEAN_SD, MEAN_FIELD_NOISE_SD * z)
    agrees = mean_err.max() <= mean_tol and np.abs(np.log(ratio)).max() <= math.log(MEAN_FIELD_SD_RATIO)
    family = "the posterior (q is full-rank)" if full_rank else "the best mean-field Gaussian"
    return bool(agrees), (
        f"q vs {family}: means {mean_err.max():.3f} posterior sd off "
        f"(tolerance {mean_tol:.2g}), sd ratios {ratio.min():.3f}-{ratio.max():.3f} "
        f"(tolerance x/÷ {MEAN_FIELD_SD_RATIO})"
    )


def compare(summary: dict, ref: dict, algorithm: str, q: dict | None = None):
    """``(agrees, detail)``: per-coordinate mean and sd against the reference (and for DPPVI on a
    Gaussian posterior, its fitted ``q`` against the best mean-field Gaussian)."""
    mean, sd = np.asarray(summary["mean"]), np.asarray(summary["sd"])
    if mean.shape != ref["mean"].shape:
        return False, f"{mean.size} coordinates, the reference has {ref['mean'].size}"
    ess, ess_sd, kurt = (np.asarray(summary[k]) for k in ("ess_mean", "ess_sd", "kurtosis"))
    names = summary["coordinates"]
    approximate = algorithm in APPROXIMATE
    if not approximate and ess.min() < MIN_ESS:
        i = int(ess.argmin())
        return False, f"too few effective draws: ESS {ess[i]:.1f} < {MIN_ESS} on {names[i]}"
    ref_sd = ref["sd"]
    mcse = np.sqrt(sd**2 / ess + ref_sd**2 / ref["ess_mean"])
    mean_tol = Z * mcse + (MEAN_ALLOWANCE_SD * ref_sd if approximate else 0.0)
    mean_err = np.abs(mean - ref["mean"])
    log_ratio = np.log(np.maximum(sd, 1e-300) / ref_sd)
    log_tol = Z * np.sqrt(_sd_log_se(ess_sd, kurt) ** 2 + _sd_log_se(ref["ess_sd"], ref["kurtosis"]) ** 2)
    if approximate:
        log_tol = log_tol + math.log(SD_RATIO_ALLOWANCE)
    mean_excess = mean_err / mean_tol
    sd_excess = np.abs(log_ratio) / log_tol
    worst_mean, worst_sd = int(mean_excess.argmax()), int(sd_excess.argmax())
    detail = (
        f"worst mean {names[worst_mean]}: {mean[worst_mean]:.4g} vs {ref['mean'][worst_mean]:.4g} "
        f"({mean_err[worst_mean] / ref_sd[worst_mean]:.2f} ref sd, tolerance "
        f"{mean_tol[worst_mean] / ref_sd[worst_mean]:.2f}); worst sd {names[worst_sd]}: ratio "
        f"{math.exp(log_ratio[worst_sd]):.3g} (tolerance x/÷ {math.exp(log_tol[worst_sd]):.3g}); "
        f"min ESS {ess.min():.0f}"
    )
    agrees = bool(mean_excess.max() <= 1.0 and sd_excess.max() <= 1.0)
    if algorithm == "DPPVI" and q is not None and ref.get("mean_field") is not None:
        mf_agrees, mf_detail = compare_mean_field(q, ref["mean_field"], ref_sd, ref["mean"])
        agrees, detail = agrees and mf_agrees, detail + "; " + mf_detail
    return agrees, detail


def _names_a_site(message, sites) -> bool:
    """The message names one of ``sites`` quoted (``'a'``, ``"a"`` or backticks): a bare
    one-letter site name would match any word."""
    return any(f"{q}{site}{q}" in message for site in sites for q in ("'", '"', "`"))


def _relevant_warnings(record):
    seen, out = set(), []
    for w in record.get("warnings", []):
        if w["category"] in IGNORED_WARNINGS or w["message"].startswith(IGNORED_MESSAGES):
            continue
        text = f"{w['category']}: {w['message']}"
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def classify(case_name, algorithm, dtype, record, seconds, timed_out, stderr, budget, ref) -> Outcome:
    """The outcome of one run (``record``: the worker's JSON, ``None`` if it died)."""
    make = lambda outcome, detail, warns=(): Outcome(
        case_name, algorithm, dtype, outcome, detail, None if seconds is None else round(seconds, 1), list(warns)
    )
    outcome = _classify(case_name, algorithm, record, timed_out, stderr, budget, ref, make)
    outcome.raw = {"record": record, "seconds": seconds, "timed_out": timed_out, "stderr": stderr, "budget": budget}
    return outcome


def _classify(case_name, algorithm, record, timed_out, stderr, budget, ref, make):
    case = models.get_case(case_name)
    if timed_out:
        return make("FAILS", f"hang: killed after the time budget of {budget:.0f} s")
    if record is None:
        return make("FAILS", f"the process died: {stderr.strip()[-600:]}")
    warns = _relevant_warnings(record)
    # the synthetic tier holds DSVGD and DPPVI to refusing client-local latents; on the real tier
    # they may infer them (then they must agree) or refuse naming the site
    may_refuse_by_design = bool(case.local_sites) and algorithm in GLOBAL_ONLY
    must_refuse = may_refuse_by_design and case.tier == "synthetic"
    if record["status"] == "error":
        err = record["error"]
        text = f"{err['type']} at {record['phase']}: {err['message']}"
        if not err["by_package"]:
            return make("FAILS", f"error from outside the package: {text}", warns)
        if err["type"] not in REFUSALS:
            return make("FAILS", f"the package crashed: {text}", warns)
        if may_refuse_by_design and not _names_a_site(err["message"], case.local_sites):
            return make(
                "FAILS", f"refused without naming the client-local site(s) {list(case.local_sites)}: {text}", warns
            )
        return make("refuses", text, warns)
    if must_refuse:
        return make("FAILS", f"ran although its latents {list(case.local_sites)} are client-local", warns)
    summary = record.get("summary")
    if summary is None:
        return make("FAILS", "finished without draws", warns)
    if summary["num_nonfinite"]:
        what = f"{summary['num_nonfinite']} non-finite values in the draws"
        return make("warns" if warns else "FAILS", what if warns else what + ", no warning", warns)
    if case.tier == "real":
        agrees, detail = compare_real(summary, ref, algorithm)
    else:
        agrees, detail = compare(summary, ref, algorithm, record.get("q"))
    if agrees:
        return make("agrees", detail, warns)
    if algorithm not in APPROXIMATE:  # an exact sampler must agree: a warning does not excuse it
        return make("FAILS", "an exact sampler disagrees" + (" (it warned)" if warns else "") + ": " + detail, warns)
    if warns:
        return make("warns", detail, warns)
    return make("FAILS", "disagrees without a warning: " + detail, warns)


def run_case(
    case_name: str, algorithm: str, dtype: str = "float32", *, budget: float | None = None, ref: dict | None = None
) -> Outcome:
    """Runs one (model, algorithm, dtype) in a child process and classifies it."""
    if algorithm not in ALGORITHMS and algorithm != "_hang":
        raise KeyError(algorithm)
    if dtype not in ("float32", "float64"):
        raise ValueError(dtype)
    case = models.get_case(case_name)
    if budget is None:
        budget = REAL_BUDGET if case.tier == "real" else DEFAULT_BUDGET
    refused_by_design = case.local_sites and algorithm in GLOBAL_ONLY and case.tier == "synthetic"
    needs_ref = not refused_by_design and algorithm != "_hang"
    if ref is None and needs_ref:
        ref = reference(case_name)
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        out = os.path.join(tmp, "run.json")
        record, seconds, timed_out, stderr = _run_child(
            ["run", case_name, algorithm, dtype, out], out, dtype == "float64", budget
        )
    if record is not None:
        seconds = record["seconds"]  # the algorithm's own time, without imports and set-up
    return classify(case_name, algorithm, dtype, record, seconds, timed_out, stderr, budget, ref)


def all_runs(tier: str = "synthetic"):
    """Every (case, algorithm, dtype) of the full zoo (``tier``: ``"synthetic"`` or ``"real"``)."""
    if tier == "real":
        from zoo.real_models import REAL_CASES

        # in the order a partial run is most useful: 4 clients in float64 (the issues' setting)
        # first, then float32, then 8 clients; the quick algorithms first within each
        cases = sorted(REAL_CASES.values(), key=lambda c: c.num_clients)
        return [
            (c.name, a, d)
            for m in sorted({c.num_clients for c in cases})
            for d in ("float64", "float32")
            for a in ("DPPVI", "DSVGD", "DADMMS", "FedZigZag")
            for c in cases
            if c.num_clients == m
        ]
    runs = []
    for case in models.CASES.values():
        for dtype in ("float32", "float64") if case.float64 else ("float32",):
            for algorithm in ALGORITHMS:
                runs.append((case.name, algorithm, dtype))
    return runs
