"""docs/guide/architecture.md: the "add an algorithm" walkthrough runs as printed."""

import subprocess
import sys
import textwrap

from test_docs import ROOT, page_examples


def test_the_walkthrough_runs_and_its_checks_hold():
    prelude = textwrap.dedent("""\
        import warnings
        warnings.simplefilter("error")
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
    """)
    code = page_examples("guide/architecture.md", float32=False)
    assert "class FedGD(VariationalMethod)" in code and "assert abs(mode" in code
    run = subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "FedGD(model, step_size=0.02)"
