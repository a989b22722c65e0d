"""The documentation stays true to the package: API page, bundled assets, stored notebooks."""

import importlib
import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import numpyro_fed

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API_PAGE = DOCS / "api.md"
PACKAGES = ("numpyro_fed", "numpyro_fed.infer", "numpyro_fed.privacy", "numpyro_fed.flower")


def api_directives():
    return set(re.findall(r"^::: ([\w.]+)\s*$", API_PAGE.read_text(), re.M))


def api_reexport_table():
    """{(package, name): module} from the table at the top of docs/api.md."""
    rows = {}
    for line in API_PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0].strip("`") not in PACKAGES:
            continue
        package = cells[0].strip("`")
        module = re.fullmatch(r"\[`([\w.]+)`\]\(#([\w.]+)\)", cells[2])
        assert module and module.group(1) == module.group(2), f"bad link in docs/api.md: {line}"
        for name in re.findall(r"`(\w+)`", cells[1]):
            rows[(package, name)] = module.group(1)
    return rows


def test_api_page_lists_every_reexport_under_the_module_that_defines_it():
    table = api_reexport_table()
    expected = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            expected[(package, name)] = getattr(module, name).__module__
    assert table == expected
    # ... and every module named there has its section on the page
    assert set(expected.values()) <= api_directives()


def test_every_lazily_imported_public_name_is_in_all():
    # numpyro_fed, numpyro_fed.infer and numpyro_fed.flower import their public names on first use: a name in
    # __all__ without a home would fail only when used, a home without __all__ would be hidden
    for package in map(importlib.import_module, ("numpyro_fed", "numpyro_fed.infer", "numpyro_fed.flower")):
        assert set(package.__all__) == set(package._WHERE), package.__name__
        assert set(package.__all__) <= set(dir(package))


def test_api_page_has_a_section_for_every_public_module():
    modules = {
        info.name
        for info in pkgutil.walk_packages(numpyro_fed.__path__, "numpyro_fed.")
        if not info.ispkg and not any(part.startswith("_") for part in info.name.split("."))
    }
    assert modules - api_directives() == set()


def test_site_scripts_are_bundled_not_fetched():
    yaml = pytest.importorskip("yaml")  # comes with the docs extra (mkdocs)

    class IgnoreTags(yaml.SafeLoader):
        """mkdocs.yml uses tags such as ``!relative``; their values do not matter here."""

    IgnoreTags.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=IgnoreTags)
    scripts = config.get("extra_javascript", [])
    assert any("mathjax" in s for s in scripts)
    for script in scripts:
        assert "://" not in script and not script.startswith("//"), script
        assert (DOCS / script).is_file(), script
    assert config["theme"].get("font") is False  # no web fonts from outside
    # the CHTML output loads its fonts relative to the script
    fonts = DOCS / "assets" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
    assert (fonts / "MathJax_Main-Regular.woff").is_file()


@pytest.mark.parametrize("page", ["index.md", "notebooks.md", "guide/algorithms.md"])
def test_pages_do_not_call_existing_algorithms_planned(page):
    text = (DOCS / page).read_text().lower()
    for stale in ("planned", "still to come", "not implemented yet", "do not exist yet"):
        assert stale not in text, f"docs/{page} says {stale!r}"


def notebook_outputs():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            for output in cell.get("outputs", []):
                text = output.get("text", "")
                yield path.name, "".join(text) if isinstance(text, list) else text


def test_stored_notebooks_carry_no_local_paths_or_tqdm_warning():
    for name, text in notebook_outputs():
        assert "TqdmWarning" not in text, name
        assert "site-packages" not in text and str(ROOT) not in text, name


def test_run_notebooks_keeps_the_tqdm_widget_warning_out_of_outputs(tmp_path):
    """NumPyro imports tqdm.auto; in a kernel without ipywidgets tqdm warns (with the path of
    the installation). The runner filters that one warning and leaves the others."""
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "tools" / "run_notebooks.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import warnings\nimport numpyro\nwarnings.warn('other warnings are kept')")
    ]
    path = tmp_path / "tiny.ipynb"
    nbformat.write(notebook, path)
    runner.run_notebook(path, timeout=120, kernel_name="python3")
    outputs = nbformat.read(path, as_version=4).cells[0].outputs
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "TqdmWarning" not in stderr and "IProgress" not in stderr
    assert "other warnings are kept" in stderr


def test_run_notebooks_stores_repository_paths_relative():
    """A warning raised in a helper module of the repository names its file; the stored
    notebook says ``../benchmarks/x.py``, not this machine's path."""
    nbformat = pytest.importorskip("nbformat")
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "tools" / "run_notebooks.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [
        nbformat.v4.new_output(
            "stream",
            name="stderr",
            text=f"{ROOT.resolve()}/notebooks/../benchmarks/x.py:3: RuntimeWarning: w\n"
            f"see {ROOT.resolve()}/docs and /usr/lib/python3/x.py\n",
        )
    ]
    notebook.cells = [cell]
    runner.relative_paths(notebook, ROOT.resolve() / "notebooks")
    assert cell.outputs[0]["text"] == (
        "../benchmarks/x.py:3: RuntimeWarning: w\nsee ../docs and /usr/lib/python3/x.py\n"
    )


def test_site_builds_strict_renders_every_reexport_and_loads_nothing_from_outside(tmp_path):
    """``make docs`` in a temporary folder: warnings are errors, every re-exported name has
    its entry on the API page (mkdocstrings hides names without a docstring), and no page
    loads a script, a style sheet or a font from another host."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    api = (site / "api" / "index.html").read_text()
    for (package, name), module in api_reexport_table().items():
        assert f'id="{module}.{name}"' in api, f"{package}.{name} has no entry on the API page"
    external = re.compile(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//', re.I)
    for page in site.rglob("*.html"):
        found = external.search(page.read_text())
        assert found is None, f"{page.relative_to(site)} loads {found.group(0)!r}"


def page_examples(page, *, float32):
    """The ``python`` code blocks of a page, in order, as one script."""
    text = (DOCS / page).read_text()
    blocks = re.findall(r"^ *```python\n(.*?)^ *```", text, re.S | re.M)
    code = "\n\n".join(textwrap.dedent(block) for block in blocks)
    if float32:
        code = code.replace("numpyro.enable_x64()", "pass  # NumPyro's default: float32")
    return code


@pytest.mark.slow
@pytest.mark.parametrize(
    "page, float32",
    [
        ("index.md", False),
        ("guide/federated-models.md", False),
        ("guide/federated-models.md", True),
        ("guide/algorithms.md", True),
    ],
)
def test_page_examples_run_without_warnings(page, float32):
    """A new user's check: the examples of the page, run one after the other in a fresh
    interpreter, finish and warn about nothing (warnings are errors, except deprecations
    raised inside third-party libraries)."""
    prelude = textwrap.dedent("""\
        import warnings
        warnings.simplefilter("error")
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
    """)
    run = subprocess.run(
        [sys.executable, "-c", prelude + page_examples(page, float32=float32)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.strip() == "", run.stderr[-3000:]


def sample_figures(text):
    """``{algorithm: (bytes sent, bytes received)}`` of the lines ``examples/ray_local.py``
    prints."""
    pattern = re.compile(r"^(\S+(?: dep\.)?)\s+max \|mean - NUTS\|.*sent ([\d,]+) B, received ([\d,]+) B$", re.M)
    return {m[1]: (int(m[2].replace(",", "")), int(m[3].replace(",", ""))) for m in pattern.finditer(text)}


@pytest.mark.slow
def test_federation_guide_sample_output_is_what_ray_local_sends(ray_session, capsys):
    """The bytes in the federation guide's sample output of ``examples/ray_local.py --quick``
    are those of a run of it today (the ledger counts the arrays sent: they change when what a
    client sends changes, and the page must follow)."""
    page = (DOCS / "guide" / "federation.md").read_text()
    block = page.split("Its `--quick` run", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    documented = sample_figures(block)
    assert set(documented) == {"FedZigZag", "DADMMS", "DPPVI", "DSVGD", "DPPVI dep."}
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import ray_local

        ray_local.main(["--quick"])
    finally:
        sys.path.remove(str(ROOT / "examples"))
    output = capsys.readouterr().out
    printed = sample_figures(output)
    lines = "\n".join(line for line in output.splitlines() if " B, received " in line or "the same draws" in line)
    assert printed == documented, f"docs/guide/federation.md's sample output is stale; a run printed:\n{lines}"
