"""docs/guide/architecture.md: the "add an algorithm" walkthrough runs as printed, in process
and, unchanged, on a local Ray (simulation and deployment) and in Flower's simulation; the
decentralized example in process and on Ray."""

import re
import subprocess
import sys
import textwrap

import pytest

from test_docs import DOCS, ROOT

PRELUDE = textwrap.dedent("""\
    import warnings
    warnings.simplefilter("error")
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.simplefilter("ignore", category)
""")


def walkthrough(*, engines: bool) -> str:
    """The page's ``python`` blocks as one script: those that run in process, or all of them."""
    text = (DOCS / "guide/architecture.md").read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"^ *```python\n(.*?)^ *```", text, re.S | re.M)]
    if not engines:
        blocks = [b for b in blocks if "RayFederation" not in b and "flower" not in b]
    return "\n\n".join(blocks)


def run_script(code: str):
    return subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_the_walkthrough_runs_in_process_and_its_checks_hold():
    code = walkthrough(engines=False)
    assert "class FedGD(VariationalMethod)" in code and "assert abs(mode" in code
    assert "federation.map(" in code and "client_data" not in code  # the core reaches clients through the seam
    run = run_script(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "FedGD(model, step_size=0.02)"


@pytest.mark.engine
def test_the_walkthrough_runs_unchanged_on_ray_and_flower():
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'numpyro_fed[ray]')")
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'numpyro_fed[flower]')")
    code = walkthrough(engines=True)
    # the three backends' checks: the same losses as in process, the ledger of real payloads
    assert code.count("np.allclose(") == 4 and "RayFederation(loader=load" in code and "flower.simulate(" in code
    run = run_script(code)
    assert run.returncode == 0, run.stderr[-3000:]
