"""Executes notebooks in place so that the committed files carry their outputs.

Usage: ``python tools/run_notebooks.py notebooks/*.ipynb`` (what ``make notebooks`` runs).

Each notebook runs in a fresh kernel of the Python that runs this script (the ``python3``
kernel that ipykernel provides for the current interpreter, so a virtualenv's packages are
used and no kernel has to be registered), with the notebook's folder as working directory.
A notebook is rewritten only when every cell succeeded; the exit status is non-zero if any
notebook failed.

The kernels run with tqdm's "IProgress not found" warning filtered out (``PYTHONWARNINGS``):
NumPyro imports ``tqdm.auto`` at import time, which in a Jupyter kernel without
``ipywidgets`` warns, with the path of the local installation, that it falls back to the
console progress bar. Executed headless, no widget could be shown anyway, so the warning is
noise in the stored outputs.

Warnings print the file of the line they name: a notebook's helper module under the
repository (``benchmarks/dppvi.py``) would store this machine's path. Before writing, every
absolute path under the repository in a stream output is rewritten relative to the
notebook's folder (``../benchmarks/dppvi.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

# -W syntax: action:message:category; the message matches at its start, case-insensitively.
TQDM_WIDGET_WARNING_FILTER = "ignore:IProgress not found"


def kernel_environment(environ=None) -> dict[str, str]:
    """The kernels' environment: ``environ`` (default ``os.environ``) plus the warning filter."""
    env = dict(os.environ if environ is None else environ)
    filters = [f for f in env.get("PYTHONWARNINGS", "").split(",") if f]
    if TQDM_WIDGET_WARNING_FILTER not in filters:
        filters.append(TQDM_WIDGET_WARNING_FILTER)
    env["PYTHONWARNINGS"] = ",".join(filters)
    return env


ROOT = Path(__file__).resolve().parent.parent


def relative_paths(notebook, folder: Path, root: Path = ROOT) -> None:
    """Rewrites, in place, absolute paths under ``root`` in ``notebook``'s stream outputs
    relative to ``folder`` (the notebook's own)."""
    pattern = re.compile(re.escape(str(root)) + r"(?:/[^\s:\"']*)?")

    def relative(match):
        return os.path.relpath(os.path.normpath(match.group(0)), folder)

    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = pattern.sub(relative, output["text"])


def run_notebook(path: Path, *, timeout: int, kernel_name: str) -> float:
    """Executes ``path`` and writes it back with its outputs; returns the run time in seconds."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    start = time.perf_counter()
    client.execute(env=kernel_environment())
    seconds = time.perf_counter() - start
    relative_paths(notebook, path.parent.resolve())
    nbformat.write(notebook, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path, help="notebook files to execute in place")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds allowed per cell (default 1200)")
    parser.add_argument("--kernel", default="python3", help="kernel name (default python3)")
    args = parser.parse_args(argv)

    failed = []
    for path in args.notebooks:
        if not path.is_file():
            print(f"FAILED {path}: no such file", file=sys.stderr)
            failed.append(path)
            continue
        print(f"running {path} ...", flush=True)
        try:
            seconds = run_notebook(path, timeout=args.timeout, kernel_name=args.kernel)
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as error:
            print(f"FAILED {path}:\n{error}", file=sys.stderr)
            failed.append(path)
            continue
        print(f"ok     {path} ({seconds:.1f} s)", flush=True)

    if failed:
        print(
            f"{len(failed)} of {len(args.notebooks)} notebook(s) failed: " + ", ".join(map(str, failed)),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
